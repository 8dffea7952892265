"""Export a ResNet-18 to ONNX into a model repository: `python examples/resnet18/export.py --model-dir DIR`.

The network is the standard ResNet-18 (He et al., 2015: a 7×7 stem, four stages of two basic residual
blocks, global average pooling, a 1000-way linear layer), written here with `torch.nn` because torchvision
does not install beside the pinned torch. Its weights are random (a fixed seed): the walkthrough in the
documentation (docs/serving/index.md) is about serving a model of your own, not about what this one predicts.

It writes `DIR/resnet18/1/model.onnx` with a dynamic batch dimension, tensors `input` [N, 3, 224, 224] and
`logits` [N, 1000], and no `config.pbtxt`: the model service completes the config from the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a shortcut; a 1×1 convolution on the shortcut where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 224×224 RGB images normalised with ImageNet's mean and std."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        widths = (64, 128, 256, 512)
        blocks = []
        for index, width in enumerate(widths):
            before = widths[index - 1] if index else 64
            blocks += [BasicBlock(before, width, 1 if index == 0 else 2), BasicBlock(width, width, 1)]
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def export(model_dir: Path, seed: int = 0) -> Path:
    """Write the ONNX file; returns its path."""
    torch.manual_seed(seed)
    model = ResNet18().eval()
    path = model_dir / "resnet18" / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, 3, 224, 224)
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},),
        dynamo=True,
        external_data=False,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, default=Path("model_repository"), help="the model repository"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"resnet18: wrote {export(args.model_dir, args.seed)}")


if __name__ == "__main__":
    main()
