"""Small model files of every kind, made in the tests, and in-process references that run the same files.

Each kind computes Y = X @ W + B (X FP32 [N, 4], Y FP32 [N, 3]) with W and B from a seed, so two versions
give different answers:

- ONNX (made with the `onnx` package's helpers): input `X`, output `Y`, and an optional input `SCALE` [N, 1]
  (an initializer gives its default, 1) that multiplies Y; the batch dimension is symbolic.
- TorchScript (traced): `forward(x)` returns the tensor; its config uses Triton's `INPUT__0`/`OUTPUT__0`.
- `torch.export` (exported with keyword arguments): `forward(X)` returns `{"Y": ...}`; batch 1..64.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ONNX_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 3 ] }} ]
"""
TORCHSCRIPT_CONFIG = """
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 3 ] }} ]
"""
EXPORT_CONFIG = """
name: "{name}"
backend: "pytorch"
max_batch_size: 8
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ 3 ] }} ]
"""
#: kind → (file name, config template, input name, output name)
KINDS = {
    "onnx": ("model.onnx", ONNX_CONFIG, "X", "Y"),
    "torchscript": ("model.pt", TORCHSCRIPT_CONFIG, "INPUT__0", "OUTPUT__0"),
    "torch_export": ("model.pt2", EXPORT_CONFIG, "X", "Y"),
}


def weights(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)


def write_onnx(path: Path, seed: int, *, batch: str | int = "N") -> Path:
    """An ONNX model Y = (X @ W + B) * SCALE, SCALE optional (default 1); `batch` names or fixes dim 0."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w, b = weights(seed)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["Z"]),
            helper.make_node("Mul", ["Z", "SCALE"], ["Y"]),
        ],
        "tiny",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, 4]),
            # Its default has one row, which broadcasts; a fixed batch keeps that one row.
            helper.make_tensor_value_info(
                "SCALE", TensorProto.FLOAT, [batch if isinstance(batch, str) else 1, 1]
            ),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, 3])],
        initializer=[
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(b, "B"),
            numpy_helper.from_array(np.ones((1, 1), np.float32), "SCALE"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _module(seed: int, *, named: bool):
    import torch
    from torch import nn

    w, b = weights(seed)
    linear = nn.Linear(4, 3)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w.T.copy()))
        linear.bias.copy_(torch.from_numpy(b))

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, X: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"Y": self.linear(X)}

    return (Named() if named else linear).eval()


def write_torchscript(path: Path, seed: int) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.jit.trace(_module(seed, named=False), torch.zeros(2, 4)).save(str(path))
    return path


def write_export(path: Path, seed: int) -> Path:
    import torch

    batch = torch.export.Dim("batch", min=1, max=64)
    with torch.no_grad():
        program = torch.export.export(
            _module(seed, named=True), (), kwargs={"X": torch.zeros(2, 4)}, dynamic_shapes={"X": {0: batch}}
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


WRITERS = {"onnx": write_onnx, "torchscript": write_torchscript, "torch_export": write_export}


def add_model(root: Path, kind: str, name: str, versions: dict[str, int], config: str | None = None) -> Path:
    """A model folder of `kind` under `root` with the given versions (version → seed) and a config (default:
    the kind's, with `name`)."""
    file_name, template, _, _ = KINDS[kind]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(template.format(name=name) if config is None else config)
    for version, seed in versions.items():
        WRITERS[kind](folder / version / file_name, seed)
    return folder


def reference(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model file run in-process by its own runtime: ONNX Runtime or PyTorch, outputs by the model's names
    (ONNX: its output names; TorchScript: OUTPUT__i; torch.export: the program's result keys)."""
    if path.suffix == ".onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, inputs), strict=True))
    import torch

    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    with torch.inference_mode():
        if path.suffix == ".pt":
            out = torch.jit.load(str(path)).eval()(*tensors.values())
            outs = out if isinstance(out, (tuple, list)) else [out]
            return {f"OUTPUT__{i}": o.numpy() for i, o in enumerate(outs)}
        result = torch.export.load(str(path)).module()(**tensors)
    return {k: v.numpy() for k, v in result.items()}
