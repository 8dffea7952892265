"""`refcnn_cnn`: the throughput workload's CNN, built from a fixed seed (no weights file), as a stage model.

The network is exactly the peers' reference model (TorchServe, MLServer and Ray Serve serve the same one):
three 3×3 stride-2 convolutions 3→32→64→128 with ReLU, global average pooling and a linear layer 128→10,
initialised by PyTorch's defaults right after `torch.manual_seed(0)`, in eval mode. Its outputs mean nothing;
it exists so that servers can be compared on the same work.

The stage model is `refcnn_cnn`, not `refcnn`: the router serves ensembles and the stage models of their steps
in one namespace, and `refcnn` is the ensemble's name.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from pipeline.stage import Stage, TensorSpec
from services.model.backends import resolve_device

log = logging.getLogger(__name__)

# Request tensors arrive as read-only views of the request bytes; torch warns when it wraps one because it
# cannot mark a tensor read-only. Nothing here writes to its input, so the copy the warning suggests is waste.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)

MODEL_NAME = "refcnn_cnn"
NUM_CLASSES = 10
#: One input's shape (no batch dimension).
INPUT_SHAPE = (3, 64, 64)
#: The seed the reference model is built from; the weights are PyTorch's default initialisation after it.
SEED = 0


def build_refcnn() -> nn.Module:
    """The reference network with its seed-0 weights, in eval mode, on the CPU.

    The global RNG is restored afterwards, so building it does not disturb anything else in the process.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        module = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, NUM_CLASSES),
        )
    return module.eval()


class RefCNNStage(Stage):
    """`INPUT` FP32 [N, 3, 64, 64] (normalised pixels) → `LOGITS` FP32 [N, 10], in PyTorch.

    The device is resolved at construction (a bad setting fails before serving); the network is built in
    `load`, on the model's own thread.

    Args:
        device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
        torch_threads: torch intra-op threads (process-wide, shared with the service's other models).
    """

    name = MODEL_NAME
    inputs = (TensorSpec("INPUT", "FP32", (-1, *INPUT_SHAPE)),)
    outputs = (TensorSpec("LOGITS", "FP32", (-1, NUM_CLASSES)),)
    max_batch_size = 256
    platform = "pytorch_libtorch"
    backend = "pytorch"

    def __init__(self, *, device: str = "auto", torch_threads: int = 1) -> None:
        if torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {torch_threads}")
        self.device, self.reason = resolve_device(device)
        self.torch_threads = torch_threads
        self._module: nn.Module | None = None

    def load(self) -> None:
        """Build the network on the device and run one warm-up batch."""
        torch.set_num_threads(self.torch_threads)
        self._module = build_refcnn().to(self.device)
        self.infer({"INPUT": np.zeros((1, *INPUT_SHAPE), dtype=np.float32)})
        log.info(
            "built %s (seed %d) with torch %s on %s (%s), %d intra-op thread(s)",
            MODEL_NAME,
            SEED,
            torch.__version__,
            self.device,
            self.reason,
            self.torch_threads,
        )

    def unload(self) -> None:
        """Drop the network; on CUDA also return the cached memory."""
        self._module = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Logits for a batch; on the CPU the input tensor shares the request's memory."""
        module = self._module
        if module is None:
            raise RuntimeError("RefCNNStage.infer called before load()")
        # No copy when the request already holds contiguous float32, the usual case.
        tensor = torch.from_numpy(np.ascontiguousarray(inputs["INPUT"], dtype=np.float32))
        with torch.inference_mode():
            if self.device != "cpu":
                tensor = tensor.to(self.device)
            out = module(tensor)
            return {"LOGITS": out.cpu().numpy() if out.device.type != "cpu" else out.numpy()}
