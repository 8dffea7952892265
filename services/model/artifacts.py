"""What a model file says about itself, and how a `config.pbtxt` is completed from it and checked against it.

Every artifact kind is read into a `Signature`: its inputs and outputs in the model's own order, with the
datatype and the full shape the model takes (the batch dimension included, -1 where a dimension varies)
where the file records them.

- ONNX (`model.onnx`): the graph's inputs (less its initializers, which make an input optional) and outputs,
  read with the `onnx` package and checked with its checker.
- `torch.export` (`model.pt2`): the exported program's arguments (named by keyword where it was exported with
  keyword arguments, else by the placeholder's name), their example metadata (dtype, shape; a symbolic
  dimension is -1) and its outputs: the keys when it returns a dict, else `OUTPUT__0`, `OUTPUT__1`, ...
- TorchScript (`model.pt`): the argument names of `forward` only; datatypes and shapes come from the config
  and are checked by the warm-up run when an instance loads.
- TensorRT (`model.plan`): the engine's I/O tensors (`services.model.tensorrt`).

`reconcile` completes a config where it is silent (Triton's auto-complete) and refuses one that disagrees
with the file, naming both files and the tensor. Config tensors are bound to the model's by name; for PyTorch
models also by Triton's convention `<NAME>__<index>`, and failing both by their order in the config.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.datatypes import datatype_of
from pipeline.protocol.errors import RepositoryError
from pipeline.protocol.model_config import config_datatype, datatype_of_config

log = logging.getLogger(__name__)

ONNX, TORCHSCRIPT, TORCH_EXPORT, TENSORRT_PLAN = "onnx", "torchscript", "torch_export", "tensorrt_plan"
#: The platform each kind reports (Triton's names; `pytorch_torch_export` for a `torch.export` program).
KIND_PLATFORMS = {
    ONNX: "onnxruntime_onnx",
    TORCHSCRIPT: "pytorch_libtorch",
    TORCH_EXPORT: "pytorch_torch_export",
    TENSORRT_PLAN: "tensorrt_plan",
}
KIND_BACKENDS = {
    ONNX: "onnxruntime",
    TORCHSCRIPT: "pytorch",
    TORCH_EXPORT: "pytorch",
    TENSORRT_PLAN: "tensorrt",
}
_SUFFIX_KINDS = {".onnx": ONNX, ".pt": TORCHSCRIPT, ".pt2": TORCH_EXPORT, ".plan": TENSORRT_PLAN}
_INDEXED = re.compile(r"^.+__(\d+)$")


def artifact_kind(path: Path, backend: str, platform: str) -> str:
    """The kind of a model file: from its suffix, else from the platform or backend that names it."""
    if path.suffix in _SUFFIX_KINDS:
        return _SUFFIX_KINDS[path.suffix]
    if platform == "pytorch_torch_export":
        return TORCH_EXPORT
    return {"onnxruntime": ONNX, "pytorch": TORCHSCRIPT, "tensorrt": TENSORRT_PLAN}[backend]


@dataclass(frozen=True)
class Tensor:
    """One input or output as the model file declares it."""

    name: str
    #: Protocol datatype ("FP32", ...), or "" where the file does not record it (TorchScript).
    datatype: str = ""
    #: The full shape the model takes, batch dimension included, -1 where it varies; None when unknown.
    shape: tuple[int, ...] | None = None
    #: An input the model can do without (an ONNX input with an initializer, an argument with a default).
    optional: bool = False


@dataclass(frozen=True)
class Signature:
    """A model file's inputs and outputs, in the model's order."""

    inputs: tuple[Tensor, ...]
    #: Empty where the file does not say (TorchScript).
    outputs: tuple[Tensor, ...] = ()
    #: Whether the outputs are known (a TorchScript file's are not).
    outputs_known: bool = True
    #: Inputs are passed by keyword (a program exported with keyword arguments), not by position.
    by_keyword: bool = False
    #: The largest batch the model was made for, where it says (a `torch.export` range); 0: unbounded.
    max_batch: int = 0
    #: Ranges of the variable dimensions per input, where the file says: name -> {axis: (low, high)}.
    ranges: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: Variable dimensions the model ties together (one symbol of a `torch.export` program): name -> {axis: symbol}.
    ties: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def batching(self) -> bool:
        """Whether every tensor's first dimension varies: the model takes batches."""
        tensors = [t for t in (*self.inputs, *self.outputs) if t.shape is not None]
        return bool(tensors) and all(t.shape is not None and t.shape[:1] == (-1,) for t in tensors)


# ---- reading files -------------------------------------------------------------------------------------------


def onnx_signature(path: Path) -> Signature:
    """The graph's inputs (initializers excluded: they are weights, or make an input optional) and outputs."""
    import onnx
    from onnx import helper

    try:
        model = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(str(path))
    except Exception as exc:  # protobuf's DecodeError, onnx's ValidationError, OSError...
        raise RepositoryError(f"{path}: not a valid ONNX model: {first_line(exc)}") from None
    initializers = {i.name for i in model.graph.initializer}

    def tensor(value: onnx.ValueInfoProto, optional: bool = False) -> Tensor:
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            raise RepositoryError(f"{path}: '{value.name}' is a {kind}, only tensors are served")
        elem = value.type.tensor_type.elem_type
        try:
            datatype = _numpy_datatype(helper.tensor_dtype_to_np_dtype(elem))
        except (KeyError, TypeError, ValueError):
            raise RepositoryError(
                f"{path}: '{value.name}' has ONNX type {onnx.TensorProto.DataType.Name(elem)}, which the protocol "
                "has no datatype for"
            ) from None
        shape = None
        if value.type.tensor_type.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                for d in value.type.tensor_type.shape.dim
            )
        return Tensor(value.name, datatype, shape, optional)

    inputs = tuple(tensor(v, v.name in initializers) for v in model.graph.input)
    return Signature(inputs=inputs, outputs=tuple(tensor(v) for v in model.graph.output))


def load_program(path: Path):  # -> torch.export.ExportedProgram
    """Read a `torch.export` program; `RepositoryError` naming the file when it is not one."""
    import torch

    try:
        return torch.export.load(str(path))
    except Exception as exc:  # a bad zip, a missing record, an unknown operator...
        raise RepositoryError(
            f"{path}: not a torch.export program (torch.export.load): {first_line(exc)}"
        ) from None


def export_signature(path: Path) -> Signature:
    """An exported program's arguments and results, with the dtypes and shapes of its example metadata."""
    import torch

    program = load_program(path)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = list(program.graph_signature.user_inputs)
    args_spec, kwargs_spec = program.call_spec.in_spec.children()
    keywords = list(kwargs_spec.context) if kwargs_spec.context else []
    if args_spec.num_leaves and keywords:
        raise RepositoryError(
            f"{path}: the program takes both positional and keyword arguments; export one or the other"
        )
    names = keywords or user_inputs
    if len(names) != len(user_inputs):
        raise RepositoryError(
            f"{path}: its arguments are nested ({program.call_spec.in_spec}); only tensors are served"
        )
    symbols = _symbol_bounds(program)

    def described(name: str, value, role: str) -> Tensor:
        if not isinstance(value, torch.Tensor):
            raise RepositoryError(f"{path}: {role} '{name}' is not a tensor ({type(value).__name__})")
        return Tensor(
            name,
            torch_datatype(value.dtype),
            # An exported program's dims may be symbolic (torch.SymInt, typed as int): those vary.
            tuple(d if type(d) is int else -1 for d in value.shape),
        )

    inputs, ranges, ties = [], {}, {}
    for name, node in zip(names, user_inputs, strict=True):
        value = placeholders[node].meta.get("val")
        inputs.append(described(name, value, "argument"))
        axes = {axis: symbols[str(d)] for axis, d in enumerate(value.shape) if str(d) in symbols}
        if axes:
            ranges[name] = axes
            ties[name] = {axis: str(d) for axis, d in enumerate(value.shape) if str(d) in symbols}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    results = list(output_node.args[0])[-len(program.graph_signature.user_outputs) :]
    out_spec = program.call_spec.out_spec
    if out_spec.type is dict:
        out_names = [str(k) for k in out_spec.context]
    else:
        out_names = [f"OUTPUT__{i}" for i in range(len(results))]
    outputs = tuple(
        described(n, r.meta.get("val"), "result") for n, r in zip(out_names, results, strict=True)
    )
    batch_highs = [axes[0][1] for axes in ranges.values() if 0 in axes]
    return Signature(
        inputs=tuple(inputs),
        outputs=outputs,
        by_keyword=bool(keywords),
        max_batch=min(batch_highs) if batch_highs and all(batch_highs) else 0,
        ranges=ranges,
        ties=ties,
    )


def _symbol_bounds(program) -> dict[str, tuple[int, int]]:  # program: torch.export.ExportedProgram
    """The bounds of each symbolic dimension of an exported program, by symbol: (low, high), high 0 where it
    has none."""
    symbols: dict[str, tuple[int, int]] = {}
    for symbol, bounds in program.range_constraints.items():
        high = bounds.upper
        symbols[str(symbol)] = (
            int(bounds.lower),
            int(high) if high != float("inf") and str(high) != "int_oo" else 0,
        )
    return symbols


def load_torchscript(path: Path, device: str = "cpu"):  # -> torch.jit.ScriptModule
    """Read a TorchScript file; `RepositoryError` naming the file when it is not one."""
    import torch

    try:
        return torch.jit.load(str(path), map_location=device).eval()
    except Exception as exc:  # a bad zip, a missing record, a TorchScript compilation error...
        raise RepositoryError(
            f"{path}: not a TorchScript module (torch.jit.load): {first_line(exc)}"
        ) from None


def torchscript_signature(path: Path) -> Signature:
    """A TorchScript module's `forward` arguments (names; optional where they have a default)."""
    module = load_torchscript(path)
    arguments = list(module.forward.schema.arguments)[1:]  # the first is self
    inputs = tuple(Tensor(a.name, optional=a.default_value is not None) for a in arguments)
    return Signature(inputs=inputs, outputs_known=False)


def torch_datatype(dtype) -> str:
    """The protocol datatype of a torch dtype."""
    import torch

    if dtype == torch.bfloat16:
        return "BF16"
    return _numpy_datatype(torch.empty(0, dtype=dtype).numpy().dtype)


def _numpy_datatype(dtype) -> str:
    import numpy as np

    return datatype_of(np.empty(0, dtype=dtype))


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (runtimes' messages run to pages), for error messages."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


# ---- completing and checking a config --------------------------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    """A config tensor bound to the model's: how a runner passes or finds it."""

    #: The config's (and the clients') name.
    name: str
    #: The model's name for it ("" where the model's outputs are unknown: found by `index`).
    model_name: str
    #: Its position among the model's inputs or outputs.
    index: int
    #: The shape the model takes or gives, batch dimension included (the config's `reshape` where it has one).
    model_shape: tuple[int, ...]
    #: The shape clients send or get.
    client_shape: tuple[int, ...]


@dataclass(frozen=True)
class Bindings:
    """Every config input and output bound to the model's."""

    inputs: tuple[Binding, ...]
    outputs: tuple[Binding, ...]


def reconcile(
    config: mc.ModelConfig,
    signature: Signature,
    *,
    artifact: Path,
    kind: str,
    source: str,
    auto_complete: bool,
    default_max_batch_size: int,
) -> Bindings:
    """Complete `config` in place from the model's signature where it is silent (auto-complete), then check
    that the two agree and bind each config tensor to the model's. `RepositoryError` names the config, the
    model file and the tensor when they disagree."""
    if not config.input or not config.output:
        if not auto_complete:
            raise RepositoryError(
                f"{source}: declares no {'input' if not config.input else 'output'} and auto-complete is "
                "off (--disable-auto-complete-config); declare input and output (name, data_type, dims) and "
                "max_batch_size"
            )
        if kind == TORCHSCRIPT:
            raise RepositoryError(
                f"{source}: {artifact} is TorchScript, whose files carry no tensor datatypes or shapes, so "
                "its config cannot be completed from it; write a config.pbtxt with max_batch_size and every "
                "input and output (name, data_type, dims), named after forward's arguments or INPUT__0, "
                "INPUT__1, ... and OUTPUT__0, ... in order"
            )
        _complete(config, signature, default_max_batch_size)
    # A tensor the config only names gets its datatype from the model file (Triton completes these too).
    for declared, found in ((config.input, signature.inputs), (config.output, signature.outputs)):
        for tensor in declared:
            if tensor.data_type != mc.TYPE_INVALID:
                continue
            own = _find(found, tensor.name, None)
            if not auto_complete or own is None or not own[1].datatype:
                raise RepositoryError(
                    f"{source}: '{tensor.name}' has no data_type, and {artifact} does not say"
                )
            tensor.data_type = config_datatype(own[1].datatype)
    where = f"{source} and {artifact}"
    batching = config.max_batch_size > 0
    unbatched = [
        t for t in (*signature.inputs, *signature.outputs) if t.shape is not None and t.shape[:1] != (-1,)
    ]
    if batching and unbatched:
        fixed = unbatched[0]
        raise RepositoryError(
            f"{where}: max_batch_size is {config.max_batch_size} but the model's '{fixed.name}' has no batch "
            f"dimension (shape {list(fixed.shape or ())}); set max_batch_size: 0 and give the full dims"
        )
    if batching and signature.max_batch and config.max_batch_size > signature.max_batch:
        raise RepositoryError(
            f"{where}: max_batch_size {config.max_batch_size} is over the {signature.max_batch} the model takes"
        )

    return _bind_all(config, signature, where, batching, torch_kind=kind in (TORCHSCRIPT, TORCH_EXPORT))


def _bind_all(
    config: mc.ModelConfig, signature: Signature, where: str, batching: bool, *, torch_kind: bool
) -> Bindings:
    """`reconcile`'s last step: each config input and output bound to the model's; `RepositoryError` for an
    input the model needs that the config leaves out, or declares optional."""
    inputs = _bind(config.input, signature.inputs, "input", where, batching, torch_kind, known=True)
    bound = {b.model_name for b in inputs}
    for index, needed in enumerate(signature.inputs):
        if needed.name not in bound and not needed.optional:
            raise RepositoryError(
                f"{where}: the model needs input '{needed.name}' (#{index}), which the config does not declare"
            )
    for config_input, binding in zip(config.input, inputs, strict=True):
        if config_input.optional and not signature.inputs[binding.index].optional:
            raise RepositoryError(
                f"{where}: input '{config_input.name}' is declared optional, but the model needs it"
            )
    outputs = _bind(
        config.output, signature.outputs, "output", where, batching, torch_kind, known=signature.outputs_known
    )
    return Bindings(tuple(inputs), tuple(outputs))


def _complete(config: mc.ModelConfig, signature: Signature, default_max_batch_size: int) -> None:
    """Triton's auto-complete: the missing inputs or outputs from the model, and `max_batch_size` (a default
    where the model batches and the config sets none)."""
    if not config.input and not config.output and config.max_batch_size == 0 and signature.batching:
        config.max_batch_size = (
            min(default_max_batch_size, signature.max_batch)
            if signature.max_batch
            else default_max_batch_size
        )
    skip = 1 if config.max_batch_size > 0 else 0
    for declared, found in ((config.input, signature.inputs), (config.output, signature.outputs)):
        if declared:
            continue
        for tensor in found:
            added = declared.add(
                name=tensor.name, data_type=config_datatype(tensor.datatype), dims=(tensor.shape or ())[skip:]
            )
            if isinstance(added, mc.ModelInput) and tensor.optional:
                added.optional = True


def _find(tensors: Sequence[Tensor], name: str, position: int | None) -> tuple[int, Tensor] | None:
    for index, tensor in enumerate(tensors):
        if tensor.name == name:
            return index, tensor
    if position is not None and 0 <= position < len(tensors):
        return position, tensors[position]
    return None


def _bind(
    declared: Sequence[mc.ModelInput | mc.ModelOutput],
    found: Sequence[Tensor],
    role: str,
    where: str,
    batching: bool,
    torch_kind: bool,
    *,
    known: bool,
) -> list[Binding]:
    names = {t.name for t in found}
    by_order = torch_kind and not any(d.name in names or _INDEXED.match(d.name) for d in declared)
    bindings, taken = [], set()
    for position, tensor in enumerate(declared):
        batch = (-1,) if batching else ()
        client = (*batch, *tensor.dims)
        model = (*batch, *tensor.reshape.shape) if tensor.HasField("reshape") else client
        datatype = datatype_of_config(tensor.data_type)
        if not known:
            indexed = _INDEXED.match(tensor.name)
            index = int(indexed.group(1)) if indexed else position
            bindings.append(Binding(tensor.name, "", index, model, client))
            continue
        match = None
        if tensor.name in names:
            match = _find(found, tensor.name, None)
        elif torch_kind:
            indexed = _INDEXED.match(tensor.name)
            match = _find(found, "\0", int(indexed.group(1)) if indexed else (position if by_order else None))
        if match is None:
            raise RepositoryError(
                f"{where}: {role} '{tensor.name}' is not one of the model's {role}s "
                f"({', '.join(t.name for t in found) or 'none'})"
            )
        index, own = match
        if index in taken:
            raise RepositoryError(
                f"{where}: {role} '{tensor.name}' names the model's '{own.name}' a second time"
            )
        taken.add(index)
        if own.datatype and own.datatype != datatype:
            raise RepositoryError(
                f"{where}: {role} '{tensor.name}': the config says {mc.DataType.Name(tensor.data_type)}, the model "
                f"has {mc.DataType.Name(config_datatype(own.datatype))}"
            )
        if own.shape is not None:
            _check_shape(tensor.name, role, model, own.shape, where, reshaped=tensor.HasField("reshape"))
        bindings.append(Binding(tensor.name, own.name, index, model, client))
    return bindings


def _check_shape(
    name: str, role: str, declared: tuple[int, ...], own: tuple[int, ...], where: str, *, reshaped: bool
) -> None:
    what = "reshape" if reshaped else "dims"
    if len(declared) != len(own) or any(d != o and o != -1 for d, o in zip(declared, own, strict=False)):
        raise RepositoryError(
            f"{where}: {role} '{name}': the config's {what} give shape {list(declared)} (batch dimension first "
            f"as -1 where max_batch_size > 0), the model's is {list(own)}"
        )


def export_onnx(
    artifact: Path, kind: str, inputs: list[Binding], outputs: list[Binding], path: Path, *, batching: bool
) -> Path:
    """Export a TorchScript module or `torch.export` program to ONNX (for TensorRT, ONNX Runtime and
    `pipeline quantize`): inputs named as the model's arguments, outputs as the config's, the batch dimension
    (and a program's other variable dimensions) dynamic."""
    import torch

    ordered = sorted(inputs, key=lambda b: b.index)
    input_names = [b.model_name for b in ordered]
    output_names = [b.model_name or b.name for b in sorted(outputs, key=lambda b: b.index)]
    if kind == TORCH_EXPORT:
        program = load_program(artifact)
        torch.onnx.export(
            program, f=str(path), input_names=input_names, output_names=output_names, dynamo=True,
            external_data=False, verbose=False,
        )  # fmt: skip
        return path
    module = load_torchscript(artifact)
    # Batch 2: a size of 1 may be specialised away.
    example = tuple(torch.zeros(tuple(2 if d == -1 else d for d in b.model_shape)) for b in ordered)
    axes = {name: {0: "batch"} for name in (*input_names, *output_names)} if batching else None
    torch.onnx.export(
        module, example, str(path), input_names=input_names, output_names=output_names, dynamic_axes=axes,
        dynamo=False, verbose=False,
    )  # fmt: skip
    return path
