"""`refcnn_cnn`: the throughput workload's CNN, built from a fixed seed (no training).

The network is exactly the peers' reference model (TorchServe, MLServer and Ray Serve serve the same one):
three 3×3 stride-2 convolutions 3→32→64→128 with ReLU, global average pooling and a linear layer 128→10,
initialised by PyTorch's defaults right after `torch.manual_seed(0)`, in eval mode. Its outputs mean nothing;
it exists so that servers can be compared on the same work. `python -m examples.models.build` writes it into
the model repository as ONNX, `refcnn_cnn/1/model.onnx`: input `INPUT` FP32 [N, 3, 64, 64], output `LOGITS`
FP32 [N, 10].

The model is `refcnn_cnn`, not `refcnn`: the router serves ensembles and the stage models of their steps in
one namespace, and `refcnn` is the ensemble's name.
"""

from __future__ import annotations

import torch
from torch import nn

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
