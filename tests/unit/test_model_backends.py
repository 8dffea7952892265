"""The model service's backend without a server: reading model files, runner choice and its reasons,
instance placement, the settings a config carries, and the TensorRT parts that run without a GPU (profile,
engine cache, the ONNX export of PyTorch files, checked against ONNX Runtime)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import InvalidInput, RepositoryError
from pipeline.runtime.repository import ModelRepository
from pipeline.runtime.service_settings import Runners
from services.model import tensorrt
from services.model.artifacts import (
    ONNX,
    TENSORRT_PLAN,
    TORCH_EXPORT,
    TORCHSCRIPT,
    Binding,
    export_onnx,
    export_signature,
    onnx_signature,
    torchscript_signature,
)
from services.model.backend import ModelBackend, ModelOptions, choose_runner, place_instances
from services.model.tensorrt import EngineCache, EngineKey, optimization_profile
from tests.model_files import add_model, reference, write_export, write_onnx, write_torchscript

GPU = mc.ModelInstanceGroup.KIND_GPU
CPU = mc.ModelInstanceGroup.KIND_CPU


def config_of(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


# ---- reading model files ----------------------------------------------------------------------------------------


def test_onnx_signature_marks_inputs_with_a_default_optional(tmp_path: Path) -> None:
    signature = onnx_signature(write_onnx(tmp_path / "m.onnx", 1))
    assert [(t.name, t.datatype, t.shape, t.optional) for t in signature.inputs] == [
        ("X", "FP32", (-1, 4), False),
        ("SCALE", "FP32", (-1, 1), True),
    ]
    assert [(t.name, t.shape) for t in signature.outputs] == [("Y", (-1, 3))]
    assert signature.batching


def test_export_signature_names_arguments_results_and_ranges(tmp_path: Path) -> None:
    signature = export_signature(write_export(tmp_path / "m.pt2", 1))
    assert signature.by_keyword and signature.max_batch == 64
    assert [(t.name, t.datatype, t.shape) for t in signature.inputs] == [("X", "FP32", (-1, 4))]
    assert [(t.name, t.datatype, t.shape) for t in signature.outputs] == [("Y", "FP32", (-1, 3))]
    assert signature.ranges == {"X": {0: (1, 64)}}


def test_torchscript_signature_has_the_argument_names_only(tmp_path: Path) -> None:
    signature = torchscript_signature(write_torchscript(tmp_path / "m.pt", 1))
    assert [t.name for t in signature.inputs] == ["input"]  # nn.Linear.forward(input)
    assert not signature.outputs_known and signature.inputs[0].shape is None


# ---- runner choice --------------------------------------------------------------------------------------------


@pytest.fixture
def tensorrt_here(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(
        tensorrt, "tensorrt_status", lambda: (True, "TensorRT 10.9 and a CUDA GPU are present")
    )


@pytest.fixture
def no_tensorrt(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tensorrt, "tensorrt_status", lambda: (False, "the tensorrt package is not installed"))


def first(chain) -> tuple[str, str, str]:
    return chain[0].runner, chain[0].device, chain[0].reason


def test_the_cpu_runs_each_file_in_its_own_runtime(no_tensorrt) -> None:
    auto = ModelOptions()
    assert first(choose_runner(ONNX, "cpu", auto, "m.onnx"))[:2] == ("onnxruntime", "cpu")
    assert first(choose_runner(TORCHSCRIPT, "cpu", auto, "m.pt"))[:2] == ("torch", "cpu")
    chain = choose_runner(TORCH_EXPORT, "cpu", auto, "m.pt2")
    assert [c.label for c in chain] == ["torch on cpu"] and "the instance is on the CPU" in chain[0].reason


def test_auto_takes_tensorrt_on_a_gpu_where_it_runs(tensorrt_here) -> None:
    for kind in (ONNX, TORCHSCRIPT, TORCH_EXPORT, TENSORRT_PLAN):
        runner, device, reason = first(choose_runner(kind, "cuda:0", ModelOptions(), "f"))
        assert (runner, device) == ("tensorrt", "cuda:0") and "TensorRT 10.9" in reason


def test_a_gpu_instance_falls_back_in_order_down_to_the_cpu(tensorrt_here, monkeypatch) -> None:
    import onnxruntime

    monkeypatch.setattr(
        onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    labels = lambda chain: [c.label for c in chain]  # noqa: E731
    assert labels(choose_runner(ONNX, "cuda:0", ModelOptions(), "m.onnx")) == [
        "tensorrt on cuda:0",
        "onnxruntime on cuda:0",
        "onnxruntime on cpu",
    ]
    assert labels(choose_runner(TORCHSCRIPT, "cuda:1", ModelOptions(), "m.pt")) == [
        "tensorrt on cuda:1",
        "torch on cuda:1",
        "torch on cpu",
    ]
    assert labels(choose_runner(TORCH_EXPORT, "cuda:0", ModelOptions(runner="onnxruntime"), "m.pt2")) == [
        "onnxruntime on cuda:0",
        "torch on cuda:0",
        "onnxruntime on cpu",
        "torch on cpu",
    ]
    chain = choose_runner(ONNX, "cuda:0", ModelOptions(), "m.onnx", strict=True)
    assert labels(chain) == ["tensorrt on cuda:0"]
    assert (
        "the fallback after tensorrt on cuda:0"
        in choose_runner(ONNX, "cuda:0", ModelOptions(), "m")[1].reason
    )


def test_auto_leaves_tensorrt_out_for_dimensions_without_bounds(tensorrt_here) -> None:
    runner, _, reason = first(
        choose_runner(ONNX, "cuda:0", ModelOptions(), "m.onnx", unbounded="input 'IDS' dimension 1")
    )
    assert runner == "onnxruntime" and "input 'IDS' dimension 1 varies without a bound" in reason


def test_auto_passes_over_what_cannot_run_and_says_why(no_tensorrt, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, device, reason = first(choose_runner(TORCH_EXPORT, "cuda:1", ModelOptions(), "m.pt2"))
    assert (runner, device) == ("torch", "cuda:1")
    assert "TensorRT is not usable (the tensorrt package is not installed)" in reason
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    runner, device, reason = first(choose_runner(ONNX, "cuda:0", ModelOptions(), "m.onnx"))
    assert (runner, device) == ("onnxruntime", "cpu") and "no CUDA provider" in reason


def test_pinned_runners_that_cannot_run_are_refused_or_passed_over(no_tensorrt) -> None:
    with pytest.raises(RepositoryError, match="runner torch cannot run a onnxruntime_onnx file"):
        choose_runner(ONNX, "cpu", ModelOptions(runner="torch"), "m.onnx")
    # TensorRT asked for on the CPU: the next runner takes the model, unless strict.
    runner, device, reason = first(choose_runner(ONNX, "cpu", ModelOptions(runner="tensorrt"), "m.onnx"))
    assert (runner, device) == ("onnxruntime", "cpu") and "TensorRT runs on a GPU" in reason
    with pytest.raises(RepositoryError, match="TensorRT runs on a GPU"):
        choose_runner(ONNX, "cpu", ModelOptions(runner="tensorrt"), "m.onnx", strict=True)
    with pytest.raises(RepositoryError, match=r"TensorRT runs on a GPU.*a TensorRT engine"):
        choose_runner(TENSORRT_PLAN, "cpu", ModelOptions(), "m.plan")
    assert first(choose_runner(ONNX, "cuda:0", ModelOptions(runner="onnxruntime"), "m"))[0] == "onnxruntime"
    # A PyTorch file runs on ONNX Runtime (as its export) when asked to, with torch as the fallback.
    chain = choose_runner(TORCHSCRIPT, "cpu", ModelOptions(runner="onnxruntime"), "m.pt")
    assert [c.label for c in chain] == ["onnxruntime on cpu", "torch on cpu"]


def test_a_tensorrt_accelerator_pins_tensorrt_on_gpus_only(no_tensorrt) -> None:
    options = ModelOptions.of(
        config_of(
            'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
            'parameters { key: "precision_mode" value: "FP16" } } ] } }'
        ),
        "config.pbtxt",
    )
    assert options.tensorrt and options.precision == "fp16"
    assert first(choose_runner(ONNX, "cpu", options, "m.onnx"))[0] == "onnxruntime"
    runner, _, reason = first(choose_runner(ONNX, "cuda:0", options, "m.onnx"))
    assert runner == "onnxruntime" and "TensorRT is not usable (the tensorrt package" in reason
    with pytest.raises(RepositoryError, match=r"TensorRT was asked for but cannot run: the tensorrt package"):
        choose_runner(ONNX, "cuda:0", options, "m.onnx", strict=True)


def test_a_pinned_runner_passed_over_is_warned_about_and_strict_refuses(tmp_path: Path, caplog) -> None:
    pinned = 'parameters [ { key: "runner", value: { string_value: "tensorrt" } } ]'
    add_model(tmp_path, "onnx", "m", {"1": 1}, config=pinned)
    entry = ModelRepository(tmp_path).read("m")
    prepared = ModelBackend(Runners(device="cpu")).prepare(entry, "1")
    assert prepared.config.parameters["runner_in_use"].string_value == "onnxruntime on cpu"
    assert prepared.config.parameters["runner_reason"].string_value == (
        "onnxruntime on cpu: tensorrt: TensorRT is not usable (TensorRT runs on a GPU, and this instance is on cpu)"
    )
    assert [r.levelname for r in caplog.records if "runner tensorrt asked for" in r.getMessage()] == [
        "WARNING"
    ]
    with pytest.raises(
        RepositoryError, match=r"TensorRT runs on a GPU, and this instance is on cpu \(runner tensorrt\)"
    ):
        ModelBackend(Runners(device="cpu", strict_runner=True)).prepare(entry, "1")


def test_tensorrt_int8_points_to_pipeline_quantize() -> None:
    int8 = (
        'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
        'parameters { key: "precision_mode" value: "INT8" } } ] } }'
    )
    with pytest.raises(
        RepositoryError, match="expected FP32 or FP16 \\(for INT8, `pipeline quantize` the model"
    ):
        ModelOptions.of(config_of(int8), "c")


def test_strict_runner_is_read_from_the_config() -> None:
    strict = 'parameters [ { key: "strict_runner", value: { string_value: "%s" } } ]'
    assert ModelOptions.of(config_of(strict % "true"), "c").strict is True
    assert ModelOptions.of(config_of(strict % "no"), "c").strict is False
    assert ModelOptions.of(config_of(""), "c").strict is None
    with pytest.raises(RepositoryError, match="parameter strict_runner is 'maybe'; expected true or false"):
        ModelOptions.of(config_of(strict % "maybe"), "c")


def test_real_tensorrt_status_here_says_what_is_missing() -> None:
    usable, why = tensorrt.tensorrt_status()
    assert why
    if not usable:
        assert "tensorrt" in why.lower() or "GPU" in why


# ---- settings from the config ----------------------------------------------------------------------------------


def test_model_options_read_parameters_and_accelerators(caplog) -> None:
    options = ModelOptions.of(
        config_of(
            'parameters [ { key: "runner" value: { string_value: "PyTorch" } },'
            ' { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "3" } },'
            ' { key: "torch_compile" value: { string_value: "true" } },'
            ' { key: "pad_value.X" value: { string_value: "0" } },'
            ' { key: "mystery" value: { string_value: "1" } } ]'
            ' optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "auto_mixed_precision" } ]'
            ' cpu_execution_accelerator: [ { name: "openvino" } ] } }'
        ),
        "m/config.pbtxt",
    )
    assert (options.runner, options.threads, options.torch_compile, options.precision) == (
        "torch",
        3,
        True,
        "fp16",
    )
    assert "m/config.pbtxt: ignoring parameter(s) this service does not act on: mystery" in caplog.text
    assert "ignoring CPU execution accelerator 'openvino'" in caplog.text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('parameters [ { key: "runner" value: { string_value: "tvm" } } ]', "parameter runner is 'tvm'"),
        (
            'parameters [ { key: "intra_op_thread_count" value: { string_value: "0" } } ]',
            "intra_op_thread_count",
        ),
        ('parameters [ { key: "torch_compile" value: { string_value: "maybe" } } ]', "torch_compile"),
        (
            'optimization { execution_accelerators { gpu_execution_accelerator: [ { name: "tensorrt" '
            'parameters { key: "precision_mode" value: "INT8" } } ] } }',
            "precision_mode is 'INT8'",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(text: str, words: str) -> None:
    with pytest.raises(RepositoryError, match=words) as info:
        ModelOptions.of(config_of(text), "m/config.pbtxt")
    assert "m/config.pbtxt" in str(info.value)


# ---- placement --------------------------------------------------------------------------------------------------


def test_instances_round_robin_over_visible_gpus() -> None:
    config = config_of("instance_group [ { count: 3, kind: KIND_GPU } ]")
    assert place_instances(config, "auto", 2, "c") == ["cuda:0", "cuda:1", "cuda:0"]


def test_named_gpus_get_count_instances_each() -> None:
    config = config_of(
        "instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 1, 0 ] }, { count: 1, kind: KIND_CPU } ]"
    )
    assert place_instances(config, "auto", 2, "c") == ["cuda:1", "cuda:1", "cuda:0", "cuda:0", "cpu"]


def test_auto_placement_follows_the_device_setting() -> None:
    config = config_of("instance_group [ { count: 2 } ]")
    assert place_instances(config, "auto", 0, "c") == ["cpu", "cpu"]
    assert place_instances(config, "auto", 1, "c") == ["cuda:0", "cuda:0"]
    assert place_instances(config, "cpu", 1, "c") == ["cpu", "cpu"]
    assert place_instances(config, "cuda:1", 2, "c") == ["cuda:1", "cuda:1"]
    assert place_instances(mc.ModelConfig(), "auto", 0, "c") == ["cpu"]


@pytest.mark.parametrize(
    ("text", "gpus", "words"),
    [
        ("instance_group [ { kind: KIND_GPU } ]", 0, "no CUDA GPU is visible"),
        ("instance_group [ { kind: KIND_GPU, gpus: [ 3 ] } ]", 2, "GPU(s) [3]"),
        ("instance_group [ { kind: KIND_CPU, gpus: [ 0 ] } ]", 1, "KIND_CPU names gpus"),
    ],
)
def test_impossible_placements_are_refused(text: str, gpus: int, words: str) -> None:
    with pytest.raises(
        RepositoryError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        place_instances(config_of(text), "auto", gpus, "c")


# ---- instances, run directly ------------------------------------------------------------------------------------


def test_a_program_refuses_dimensions_outside_its_export_ranges(tmp_path: Path) -> None:
    add_model(tmp_path, "torch_export", "m", {"1": 1})
    (instance,) = (
        ModelBackend(Runners(device="cpu")).prepare(ModelRepository(tmp_path).read("m"), "1").instances
    )
    instance.load()
    x = np.zeros((8, 4), np.float32)
    np.testing.assert_allclose(
        instance.run({"X": x})["Y"], reference(tmp_path / "m" / "1" / "model.pt2", {"X": x})["Y"]
    )
    with pytest.raises(InvalidInput, match=r"X: batch size is 65, the model takes 1..64"):
        instance.run({"X": np.zeros((65, 4), np.float32)})


def test_a_config_batch_over_the_programs_is_refused(tmp_path: Path) -> None:
    add_model(tmp_path, "torch_export", "m", {"1": 1}, config='backend: "pytorch" max_batch_size: 100')
    with pytest.raises(RepositoryError, match="max_batch_size 100 is over the 64 the model takes"):
        ModelBackend(Runners(device="cpu")).prepare(ModelRepository(tmp_path).read("m"), "1")


# ---- TensorRT, the parts that run without a GPU -------------------------------------------------------------


def test_engine_key_changes_with_each_of_its_parts() -> None:
    profile = {"X": ((1, 4), (8, 4), (8, 4))}
    base = EngineKey.of("m", "hash", "fp32", "10.9", "H200", profile)
    assert base.digest == EngineKey.of("m", "hash", "fp32", "10.9", "H200", dict(profile)).digest
    others = [
        EngineKey.of("m", "other", "fp32", "10.9", "H200", profile),
        EngineKey.of("m", "hash", "fp16", "10.9", "H200", profile),
        EngineKey.of("m", "hash", "fp32", "11.0", "H200", profile),
        EngineKey.of("m", "hash", "fp32", "10.9", "A100", profile),
        EngineKey.of("m", "hash", "fp32", "10.9", "H200", {"X": ((1, 4), (4, 4), (8, 4))}),
    ]
    assert len({base.digest, *(k.digest for k in others)}) == 6


def test_profile_spans_one_to_max_batch_and_the_programs_ranges() -> None:
    profile = optimization_profile(
        [("IDS", (-1, -1)), ("X", (-1, 4))], {"IDS": {1: (1, 512)}}, max_batch_size=32, preferred_batch_size=8
    )
    assert profile == {"IDS": ((1, 1), (8, 512), (32, 512)), "X": ((1, 4), (8, 4), (32, 4))}
    with pytest.raises(RepositoryError, match="input 'IDS' dimension 1 varies"):
        optimization_profile([("IDS", (-1, -1))], {}, max_batch_size=4, source="m.onnx")


def test_engine_cache_lookup_and_store(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    key = EngineKey.of("m/1", "hash", "fp32", "10.9", "H200", {"X": ((1, 4), (2, 4), (2, 4))})
    assert cache.lookup(key) is None
    path = cache.store(key, b"engine")
    assert cache.lookup(key) == b"engine" and path.parent.name == "m_1"
    assert cache.entries() == [path] and path.with_suffix(".json").is_file()


@pytest.mark.parametrize("kind", ["torchscript", "torch_export"])
def test_pytorch_files_export_to_onnx_with_a_dynamic_batch(tmp_path: Path, kind: str) -> None:
    """What TensorRT builds from: the ONNX export of a PyTorch file, checked here with ONNX Runtime."""
    import onnxruntime as ort

    writer, name = (write_torchscript, "model.pt") if kind == "torchscript" else (write_export, "model.pt2")
    artifact = writer(tmp_path / name, 5)
    input_name = "input" if kind == "torchscript" else "X"
    output = Binding(
        "OUTPUT__0" if kind == "torchscript" else "Y",
        "" if kind == "torchscript" else "Y",
        0,
        (-1, 3),
        (-1, 3),
    )
    onnx_path = export_onnx(
        artifact,
        TORCHSCRIPT if kind == "torchscript" else TORCH_EXPORT,
        [Binding("X", input_name, 0, (-1, 4), (-1, 4))],
        [output],
        tmp_path / "model.onnx",
        batching=True,
    )
    signature = onnx_signature(onnx_path)
    assert signature.inputs[0].name == input_name and signature.inputs[0].shape[0] == -1
    session = ort.InferenceSession(str(onnx_path))
    for batch in (1, 7):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        (got,) = session.run(None, {input_name: x})
        expected = next(
            iter(reference(artifact, {input_name if kind == "torch_export" else "x": x}).values())
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


# ---- completing and checking configs ----------------------------------------------------------------------------


def reconciled(config: str, signature, kind: str = ONNX, **settings):
    from services.model.artifacts import reconcile

    parsed = config_of(config)
    bindings = reconcile(
        parsed,
        signature,
        artifact=Path("m/1/model"),
        kind=kind,
        source="m/config.pbtxt",
        auto_complete=settings.get("auto_complete", True),
        default_max_batch_size=4,
    )
    return parsed, bindings


def test_an_input_declared_optional_must_be_optional_in_the_model(tmp_path: Path) -> None:
    signature = onnx_signature(write_onnx(tmp_path / "m.onnx", 1))
    tensors = 'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ] max_batch_size: 4 '
    x = 'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ] '
    with pytest.raises(RepositoryError, match="input 'X' is declared optional, but the model needs it"):
        reconciled(x + tensors, signature)
    scale = 'input [ { name: "SCALE" data_type: TYPE_FP32 dims: [ 1 ] } ] '
    with pytest.raises(RepositoryError, match=r"the model needs input 'X' \(#0\)"):
        reconciled(scale + tensors, signature)


def test_pytorch_tensors_bind_by_name_by_index_or_by_order() -> None:
    from services.model.artifacts import Signature, Tensor

    signature = Signature(inputs=(Tensor("image"), Tensor("scale", optional=True)), outputs_known=False)
    outputs = 'output [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    by_name = 'input [ { name: "scale" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "image" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    _, bindings = reconciled(by_name + outputs, signature, TORCHSCRIPT)
    assert [(b.name, b.model_name, b.index) for b in bindings.inputs] == [
        ("scale", "scale", 1),
        ("image", "image", 0),
    ]
    by_index = 'input [ { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    indexed = 'output [ { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    _, bindings = reconciled(by_index + indexed, signature, TORCHSCRIPT)
    assert [(b.model_name, b.index) for b in bindings.inputs] == [("scale", 1), ("image", 0)]
    assert [(b.name, b.index) for b in bindings.outputs] == [("OUTPUT__1", 1)]
    by_order = 'input [ { name: "PIXELS" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    _, bindings = reconciled(by_order + outputs, signature, TORCHSCRIPT)
    assert [(b.name, b.model_name) for b in bindings.inputs] == [("PIXELS", "image")]
    assert [(b.name, b.index) for b in bindings.outputs] == [("A", 0), ("B", 1)]
    with pytest.raises(RepositoryError, match="input 'other' is not one of the model's inputs"):
        reconciled(
            'input [ { name: "image" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "other" data_type: TYPE_FP32 dims: [ 1 ] } ]'
            + outputs,
            signature,
            TORCHSCRIPT,
        )
