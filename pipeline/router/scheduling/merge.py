"""Which requests may share a stage call, and their tensors merged into it and split back
(`pipeline.protocol.tensor_batch`, the rule every batch follows).

Fixed-shape tensors merge by joining their raw bytes and split by byte offsets: no element is decoded. Only
tensors a stage declares padded (`TensorSpec.pad_value`) are touched element-wise: requests whose variable
dimensions differ are padded to the batch's largest (BYTES with empty elements), and outputs whose variable
dimensions follow those inputs are cut back to each request's own extent.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.ensemble.plan import ModelSignature
from pipeline.protocol.call_chain import CallChain
from pipeline.protocol.codec import Tensor
from pipeline.protocol.tensor_batch import merge_tensors, split_tensors


@dataclass(slots=True)
class BatchMember:
    """One request's share of a stage call: its inputs by stage tensor name, and the outputs it wants."""

    inputs: dict[str, Tensor]
    outputs: tuple[str, ...]
    #: The model version asked for ("" for the default).
    version: str = ""
    #: When the request gives up (`time.monotonic()`), None for never: a batch's stage call gets the latest
    #: of its members' deadlines, so that no stage works on for a batch every member has given up on.
    deadline: float | None = None
    #: The chain of model calls the request belongs to, when a model made it (Triton's BLS): a batch's
    #: stage call carries its members' chains merged.
    chain: CallChain | None = None
    #: How many clients' requests it carries: more than one where the compiled front merged them into one.
    requests: int = 1
    #: Dimension 0: how many items the request carries (read from its inputs).
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = next(iter(self.inputs.values())).shape[0]


class TensorBatching:
    """How to merge and split one stage model's tensors, from its signature."""

    def __init__(self, signature: ModelSignature) -> None:
        self.pad = {s.name: s.pad_value for s in signature.inputs if s.pad_value is not None}
        # For each padded output: dim -> the padded input whose extent at that dim it follows.
        self.follows: dict[str, dict[int, str]] = {}
        for out in signature.outputs:
            if out.pad_value is None:
                continue
            dims = {}
            for d in range(1, len(out.shape)):
                if out.shape[d] != -1:
                    continue
                source = next(
                    (
                        s.name
                        for s in signature.inputs
                        if s.name in self.pad and len(s.shape) > d and s.shape[d] == -1
                    ),
                    None,
                )
                if source is not None:
                    dims[d] = source
            self.follows[out.name] = dims

    def key(self, call: BatchMember) -> Hashable:
        """Requests with equal keys can share a batch: same outputs, datatypes, and shapes (but padded dims)."""
        return (
            call.version,
            call.outputs,
            tuple(
                (name, t.datatype, len(t.shape) if name in self.pad else t.shape[1:])
                for name, t in sorted(call.inputs.items())
            ),
        )

    def merge(self, calls: Sequence[BatchMember]) -> list[Tensor]:
        """The inputs of one stage call carrying every request, in order."""
        return merge_tensors([call.inputs for call in calls], self.pad)

    def split(self, outputs: Mapping[str, Tensor], calls: Sequence[BatchMember]) -> list[dict[str, Tensor]]:
        """Each request's share of the stage's outputs (only the outputs it asked for); `BatchShapeError`
        where an output is not one row per item of the batch."""
        extents = {
            name: [
                {d: call.inputs[source].shape[d] for d, source in follows.items() if source in call.inputs}
                for call in calls
            ]
            for name, follows in self.follows.items()
            if follows and name in outputs
        }
        shares = split_tensors(outputs, [call.size for call in calls], extents)
        for share, call in zip(shares, calls, strict=True):
            if len(share) != len(call.outputs):
                for name in [name for name in share if name not in call.outputs]:
                    del share[name]
        return shares
