"""The python backend: model.py files as Stage subclasses or Triton Python models, their configs, parameters,
instances, and every bad model.py refused with the file and the cause."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.errors import InvalidInput, RepositoryError, StageError
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.python_backend import PythonBackend
from pipeline.stage.triton_model import triton_json
from pipeline.stage.triton_python_backend_utils import triton_string_to_numpy
from tests.stages import TRITON_ADD_SUB_CONFIG, TRITON_ADD_SUB_MODEL, write_model

SCALE = """
import numpy as np
from pipeline.stage import Stage, TensorSpec

class Scale(Stage):
    max_batch_size = 8
    inputs = (TensorSpec("X", "FP32", (-1, -1)),)
    outputs = (TensorSpec("Y", "FP32", (-1, -1)),)
    factor = 2.0

    def load(self):
        self.factor = float(self.parameters.get("factor", "2"))
        self.loaded_with = dict(self.parameters)

    def infer(self, inputs):
        return {"Y": inputs["X"] * self.factor}
"""


def prepare(root: Path, name: str, version: str = "1"):
    return PythonBackend().prepare(ModelRepository(root).read(name), version)


def loaded(root: Path, name: str):
    prepared = prepare(root, name)
    for instance in prepared.instances:
        instance.load()
    return prepared


def refused(root: Path, name: str) -> str:
    with pytest.raises(RepositoryError) as caught:
        loaded(root, name)
    return caught.value.message


# ---- Stage subclasses -------------------------------------------------------------------------------------------


def test_a_stage_subclass_is_named_after_its_folder_and_declares_the_config(tmp_path: Path) -> None:
    write_model(tmp_path, "doubler", SCALE)
    prepared = loaded(tmp_path, "doubler")
    config = prepared.config
    assert config.name == "doubler" and config.backend == "python" and config.max_batch_size == 8
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("X", mc.TYPE_FP32, [-1])]
    assert [t.name for t in config.output] == ["Y"]
    [instance] = prepared.instances
    assert instance.stage.name == "doubler"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(instance.run({"X": x})["Y"], x * 2)


def test_config_parameters_reach_the_stage_before_load(tmp_path: Path) -> None:
    write_model(
        tmp_path,
        "scale",
        SCALE,
        'backend: "python"\nparameters { key: "factor" value { string_value: "3" } }\n',
    )
    [instance] = loaded(tmp_path, "scale").instances
    assert instance.stage.loaded_with == {"factor": "3"}
    np.testing.assert_array_equal(instance.run({"X": np.ones((1, 2), np.float32)})["Y"], [[3.0, 3.0]])


def test_the_config_wins_where_it_declares_tensors_and_must_agree_with_the_class(tmp_path: Path) -> None:
    write_model(
        tmp_path,
        "scale",
        SCALE,
        'backend: "python"\nmax_batch_size: 4\n'
        'input { name: "X" data_type: TYPE_FP32 dims: [5] }\noutput { name: "Y" data_type: TYPE_FP32 dims: [5] }\n',
    )
    prepared = loaded(tmp_path, "scale")
    assert prepared.config.max_batch_size == 4 and list(prepared.config.input[0].dims) == [5]
    stage = prepared.instances[0].stage
    assert stage.max_batch_size == 4 and stage.inputs[0].shape == (-1, 5)

    (tmp_path / "scale" / "config.pbtxt").write_text(
        'input { name: "X" data_type: TYPE_INT32 dims: [5] }\noutput { name: "Y" data_type: TYPE_FP32 dims: [5] }\n'
    )
    message = refused(tmp_path, "scale")
    assert "config.pbtxt" in message and "input 'X' is INT32 [5] there but FP32 [-1]" in message
    (tmp_path / "scale" / "config.pbtxt").write_text(
        'input { name: "Z" data_type: TYPE_FP32 dims: [5] }\noutput { name: "Y" data_type: TYPE_FP32 dims: [5] }\n'
    )
    assert "its inputs (Z) differ from those" in refused(tmp_path, "scale")


def test_a_stage_without_tensors_takes_them_from_the_config_or_is_refused(tmp_path: Path) -> None:
    source = (
        "from pipeline.stage import Stage\n\nclass Echo(Stage):\n"
        "    def infer(self, inputs):\n        return {'OUT': inputs['IN']}\n"
    )
    path = write_model(tmp_path, "echo", source)
    message = refused(tmp_path, "echo")
    assert str(path) in message and "declares no inputs or outputs" in message
    (tmp_path / "echo" / "config.pbtxt").write_text(
        'input { name: "IN" data_type: TYPE_STRING dims: [1] }\noutput { name: "OUT" data_type: TYPE_STRING dims: [1] }\n'
    )
    [instance] = loaded(tmp_path, "echo").instances
    assert instance.stage.inputs[0].datatype == "BYTES" and instance.stage.max_batch_size == 0


def test_instance_group_count_gives_that_many_stage_objects(tmp_path: Path) -> None:
    write_model(tmp_path, "scale", SCALE, "instance_group [{ count: 3 kind: KIND_CPU }]\n")
    prepared = loaded(tmp_path, "scale")
    stages = [instance.stage for instance in prepared.instances]
    assert len(stages) == 3 and len({id(s) for s in stages}) == 3
    assert (
        prepared.config.instance_group[0].name == "scale_0" and prepared.config.instance_group[0].count == 3
    )


def test_a_reload_imports_the_edited_file(tmp_path: Path) -> None:
    path = write_model(tmp_path, "scale", SCALE)
    first = loaded(tmp_path, "scale").instances[0]
    # Same size, same second: a bytecode cache keyed by mtime would serve the old code.
    path.write_text(SCALE.replace("factor = 2.0", "factor = 5.0").replace('"2"', '"5"'))
    second = loaded(tmp_path, "scale").instances[0]
    x = np.ones((1, 1), np.float32)
    assert first.run({"X": x})["Y"][0, 0] == 2.0 and second.run({"X": x})["Y"][0, 0] == 5.0
    assert type(first.stage).__module__ != type(second.stage).__module__
    assert not (path.parent / "__pycache__").exists()


def test_unloading_the_last_instance_forgets_the_module(tmp_path: Path) -> None:
    write_model(tmp_path, "scale", SCALE, "instance_group [{ count: 2 }]\n")
    prepared = loaded(tmp_path, "scale")
    name = type(prepared.instances[0].stage).__module__
    prepared.instances[0].unload()
    assert name in sys.modules
    prepared.instances[1].unload()
    assert name not in sys.modules


def test_the_example_repository_serves_every_example_stage() -> None:
    repository = ModelRepository(Path(__file__).resolve().parents[2] / "model_repository")
    entries = repository.entries(PythonBackend.names)
    assert set(entries) >= {
        "digits_preprocess",
        "embeddings_tokenize",
        "refcnn_preprocess",
        "digits_postprocess",
        "embeddings_pool",
        "refcnn_postprocess",
        "textgen_tokenize",
        "textgen_generate",
        "textgen_detokenize",
    }
    for name, entry in entries.items():
        assert not isinstance(entry, RepositoryError), entry
        prepared = PythonBackend().prepare(entry, entry.served_versions()[-1])
        assert prepared.config.name == name and prepared.instances


# ---- Triton's Python backend ------------------------------------------------------------------------------------

ARGS_AND_ERRORS = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

SEEN = []


class TritonPythonModel:
    def initialize(self, args):
        SEEN.append(("initialize", args))
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            SEEN.append(("execute", x.shape))
            if (x < 0).any():
                error = pb_utils.TritonError("X must not be negative", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            if (x == 7).any():
                raise pb_utils.TritonModelException("seven is not allowed")
            if (x == 9).any():
                reply = pb_utils.InferenceRequest(model_name="other", inputs=[], requested_output_names=["Y"]).exec()
                raise pb_utils.TritonModelException(reply.error().message())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return responses

    def finalize(self):
        SEEN.append(("finalize", None))
"""
ARGS_CONFIG = """
backend: "python"
max_batch_size: 16
input { name: "X" data_type: TYPE_INT32 dims: [2] }
output { name: "Y" data_type: TYPE_INT32 dims: [2] }
instance_group [{ count: 2 kind: KIND_CPU }]
"""


def test_an_unmodified_triton_python_model_runs(tmp_path: Path) -> None:
    write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG)
    prepared = loaded(tmp_path, "add_sub")
    assert prepared.config.backend == "python" and prepared.config.max_batch_size == 0
    [instance] = prepared.instances
    a, b = np.random.default_rng(0).random((2, 4), dtype=np.float32)
    out = instance.run({"INPUT0": a, "INPUT1": b})
    np.testing.assert_allclose(out["OUTPUT0"], a + b)
    np.testing.assert_allclose(out["OUTPUT1"], a - b)
    assert out["OUTPUT0"].dtype == np.float32
    instance.unload()


def test_triton_args_and_the_batch_as_one_request(tmp_path: Path) -> None:
    path = write_model(tmp_path, "probe", ARGS_AND_ERRORS, ARGS_CONFIG)
    prepared = loaded(tmp_path, "probe")
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    inits = [args for what, args in module.SEEN if what == "initialize"]
    assert len(inits) == 2
    assert {a["model_instance_name"] for a in inits} == {"probe_0_0", "probe_0_1"}
    args = inits[0]
    assert args["model_name"] == "probe" and args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_repository"] == str(tmp_path / "probe")
    config = json.loads(args["model_config"])
    assert config["name"] == "probe" and config["max_batch_size"] == 16
    assert config["input"][0] == {**config["input"][0], "name": "X", "data_type": "TYPE_INT32", "dims": [2]}
    assert config["instance_group"][0]["count"] == 2

    instance = prepared.instances[0]
    x = np.arange(6, dtype=np.int32).reshape(3, 2)
    np.testing.assert_array_equal(instance.run({"X": x})["Y"], x + 1)
    assert ("execute", (3, 2)) in module.SEEN  # the whole batch in one request

    with pytest.raises(InvalidInput, match="X must not be negative"):
        instance.run({"X": -x})
    with pytest.raises(StageError, match="seven is not allowed") as raised:
        instance.run({"X": np.full((1, 2), 7, np.int32)})
    assert raised.value.code == grpc.StatusCode.INTERNAL, "a TritonModelException is INTERNAL, as in Triton"
    # Run outside a stage service's request, a call to another model has nowhere to go: an error response.
    with pytest.raises(StageError, match=r"a call to model 'other'.*only while the service runs a request"):
        instance.run({"X": np.full((1, 2), 9, np.int32)})
    for each in prepared.instances:
        each.unload()
    assert module.SEEN.count(("finalize", None)) == 2


def test_a_triton_model_needs_a_config_declaring_its_tensors(tmp_path: Path) -> None:
    path = write_model(tmp_path, "add_sub", TRITON_ADD_SUB_MODEL)
    message = refused(tmp_path, "add_sub")
    assert str(path) in message and "in a config.pbtxt beside its version folders" in message
    assert "or by its auto_complete_config" in message


def test_a_triton_model_whose_initialize_raises_is_refused(tmp_path: Path) -> None:
    source = TRITON_ADD_SUB_MODEL.replace('"OUTPUT1")\n', '"OUTPUT9")\n', 1)
    path = write_model(tmp_path, "add_sub", source, TRITON_ADD_SUB_CONFIG)
    message = refused(tmp_path, "add_sub")
    assert str(path) in message and "initialize failed" in message and "TypeError" in message


def test_triton_json_uses_field_names_and_numbers() -> None:
    config = mc.ModelConfig(name="m", max_batch_size=2)
    config.input.add(name="X", data_type=mc.TYPE_FP16, dims=[3, -1])
    data = triton_json(config)
    assert data["input"][0]["dims"] == [3, -1] and data["input"][0]["data_type"] == "TYPE_FP16"
    assert data["max_batch_size"] == 2 and data["output"] == []
    assert triton_string_to_numpy("TYPE_STRING") is np.object_
    assert triton_string_to_numpy("TYPE_FP32") is np.float32


# ---- bad model.py files: refused with the file and the cause ----------------------------------------------------


def test_a_model_py_that_raises_on_import_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = write_model(tmp_path, "broken", "import os\n\nVALUE = 1 / 0\n")
    message = refused(tmp_path, "broken")
    assert message.startswith(str(path))
    assert "line 3 (`VALUE = 1 / 0`)" in message and "ZeroDivisionError: division by zero" in message


def test_a_model_py_importing_a_missing_package_names_it(tmp_path: Path) -> None:
    write_model(tmp_path, "broken", "import not_a_package_anywhere\n")
    message = refused(tmp_path, "broken")
    assert "line 1" in message and "ModuleNotFoundError" in message and "not_a_package_anywhere" in message


def test_a_model_py_with_a_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write_model(tmp_path, "broken", "x = 1\ndef f(:\n")
    message = refused(tmp_path, "broken")
    assert str(path) in message and "line 2" in message and "SyntaxError" in message


def test_a_model_py_calling_exit_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path, "broken", "import sys\nsys.exit(3)\n")
    assert "SystemExit: 3" in refused(tmp_path, "broken")


def test_a_model_py_defining_no_model_is_refused(tmp_path: Path) -> None:
    # A Stage subclass imported into the file is not the file's own.
    path = write_model(tmp_path, "empty", "from tests.stages import Scale\n")
    message = refused(tmp_path, "empty")
    assert str(path) in message and "defines no Stage subclass and no TritonPythonModel" in message


def test_a_model_py_defining_two_stages_is_refused(tmp_path: Path) -> None:
    source = SCALE + "\n\nclass Other(Scale):\n    pass\n"
    path = write_model(tmp_path, "two", source)
    message = refused(tmp_path, "two")
    assert str(path) in message and "defines 2 Stage subclasses (Scale, Other)" in message


def test_a_model_py_defining_a_stage_and_a_triton_model_is_refused(tmp_path: Path) -> None:
    write_model(
        tmp_path, "both", SCALE + TRITON_ADD_SUB_MODEL, TRITON_ADD_SUB_CONFIG.replace("add_sub", "both")
    )
    assert "defines both a Stage subclass (Scale) and TritonPythonModel" in refused(tmp_path, "both")


def test_a_stage_whose_load_raises_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write_model(
        tmp_path, "scale", SCALE, 'parameters { key: "factor" value { string_value: "a lot" } }\n'
    )
    message = refused(tmp_path, "scale")
    assert str(path) in message and "Scale.load() failed" in message
    assert "could not convert string to float: 'a lot'" in message


def test_a_failed_import_leaves_no_module_behind(tmp_path: Path) -> None:
    path = write_model(tmp_path, "broken", "raise RuntimeError('no')\n")
    before = set(sys.modules)
    refused(tmp_path, "broken")
    assert not [n for n in set(sys.modules) - before if getattr(sys.modules[n], "__file__", "") == str(path)]


# ---- confinement ------------------------------------------------------------------------------------------------


def test_a_model_py_linking_outside_the_repository_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.py"
    outside.write_text(SCALE)
    root = tmp_path / "repository"
    (root / "linked" / "1").mkdir(parents=True)
    os.symlink(outside, root / "linked" / "1" / "model.py")
    message = refused(root, "linked")
    assert "leads outside the repository" in message


def test_default_model_filename_cannot_leave_the_version_folder(tmp_path: Path) -> None:
    write_model(
        tmp_path / "repository", "escape", SCALE, 'backend: "python"\ndefault_model_filename: "../../x.py"\n'
    )
    (tmp_path / "x.py").write_text(SCALE)
    assert "is not a plain file name" in refused(tmp_path / "repository", "escape")


# ---- the services' flags ----------------------------------------------------------------------------------------


def test_stage_services_take_the_repository_flags_in_triton_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.runtime.service_settings import Loading, stage_settings
    from pipeline.stage.service import python_service_parser, repository_models

    def parse(service: str, argv: list[str]) -> tuple[Path, list[str] | None]:
        settings = stage_settings(service).parse(python_service_parser(service), argv)
        return settings.model_dir, repository_models(settings.group(Loading))

    argv = ["--model-repository", "/srv/models", "--load-model", "a", "--load-model", "b"]
    assert parse("preprocess", argv) == (Path("/srv/models"), ["a", "b"])
    assert parse("preprocess", []) == (Path("model_repository"), None)

    monkeypatch.setenv("PIPELINE_MODEL_DIR", "/data/repository")
    monkeypatch.setenv("PIPELINE_POSTPROCESS_LOAD_MODEL", "x, y")
    assert parse("postprocess", []) == (Path("/data/repository"), ["x", "y"])
    assert parse("postprocess", ["--load-model", "z"])[1] == ["z"]


def test_a_stage_that_does_not_implement_infer_is_refused_saying_so(tmp_path: Path) -> None:
    path = write_model(tmp_path, "lazy", "from pipeline.stage import Stage\n\nclass Lazy(Stage):\n    pass\n")
    message = refused(tmp_path, "lazy")
    assert str(path) in message and "Stage subclass Lazy is abstract: it does not implement infer" in message


def test_tensors_cross_to_torch_and_back_through_dlpack() -> None:
    import torch

    from pipeline.stage.triton_python_backend_utils import Tensor

    readonly = np.arange(4, dtype=np.float32)
    readonly.flags.writeable = False  # as inputs arrive
    as_torch = torch.utils.dlpack.from_dlpack(Tensor("X", readonly).to_dlpack())
    assert as_torch.tolist() == [0.0, 1.0, 2.0, 3.0]
    back = Tensor.from_dlpack("Y", torch.utils.dlpack.to_dlpack(as_torch * 2))
    assert back.name() == "Y" and back.as_numpy().tolist() == [0.0, 2.0, 4.0, 6.0]
    assert Tensor.from_dlpack("Z", torch.ones(2)).as_numpy().tolist() == [1.0, 1.0]
