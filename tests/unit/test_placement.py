"""Which stage service serves which Python model: decided once, from the ensembles and the models' own
instance_group (a Python model that asks for GPUs is the model service's, and a TorchServe archive's)."""

from __future__ import annotations

from pathlib import Path

from pipeline.ensemble.catalog import repository_ensembles
from pipeline.ensemble.pbtxt import load_repository_ensembles
from pipeline.runtime.repository import ModelRepository
from pipeline.stage.placement import (
    model_service_models,
    python_models_of,
    unplaced_python_models,
)
from pipeline.tools.model_store import LauncherModelStore, write_store_models
from tests.stages import EXAMPLE_REPOSITORY, write_model
from tests.torchserve.archive import archive_with_zipfile

PYTHON = "class M:\n    pass\n"


def _ensemble(root: Path, name: str, steps: list[tuple[str, str, str]]) -> None:
    """A config.pbtxt ensemble of (model, input tensor, output tensor) steps, X in and Y out."""
    text = [f'name: "{name}"', 'platform: "ensemble"', "max_batch_size: 8"]
    text.append('input [{ name: "X" data_type: TYPE_FP32 dims: [1] }]')
    text.append('output [{ name: "Y" data_type: TYPE_FP32 dims: [1] }]')
    text.append("ensemble_scheduling { step [")
    text.append(
        ",\n".join(
            f'{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "{source}" }} '
            f'output_map {{ key: "OUT" value: "{target}" }} }}'
            for model, source, target in steps
        )
    )
    text.append("] }")
    (root / name).mkdir(parents=True)
    (root / name / "config.pbtxt").write_text("\n".join(text) + "\n")


def test_the_example_ensembles_place_each_python_model_where_their_steps_name_it() -> None:
    repository = ModelRepository(EXAMPLE_REPOSITORY)
    plans = repository_ensembles(EXAMPLE_REPOSITORY)
    assert python_models_of("preprocess", repository, plans) == [
        "digits_preprocess",
        "embeddings_tokenize",
        "pagenumber_bls",  # no ensemble calls it: the preprocess service's
        "pagenumber_segment",
        "refcnn_preprocess",
        "textgen_tokenize",
    ]
    # The generators' instance_group asks for a GPU: they run in the model service, which has the devices.
    assert python_models_of("model", repository, plans) == ["textgen_generate", "textgen_state"]
    # digits_blank runs on the gated ensemble's blank branch, which names the postprocess stage.
    assert python_models_of("postprocess", repository, plans) == [
        "digits_blank",
        "digits_postprocess",
        "embeddings_pool",
        "pagenumber_join",
        "refcnn_postprocess",
        # After textgen's decoupled generator: it handles each of the generator's responses.
        "textgen_detokenize",
    ]


def test_a_config_pbtxt_ensemble_places_by_the_steps_before_each_python_step(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    for name in ("decode", "augment", "softmax", "spare"):
        write_model(root, name, PYTHON, 'backend: "python"\n')
    (root / "cnn" / "1").mkdir(parents=True)
    (root / "cnn" / "1" / "model.onnx").write_bytes(b"")  # an ONNX model: the model service runs it
    # decode -> augment -> cnn -> softmax: two Python steps before the model, one after.
    _ensemble(
        root,
        "classify",
        [("decode", "X", "a"), ("augment", "a", "b"), ("cnn", "b", "c"), ("softmax", "c", "Y")],
    )
    repository = ModelRepository(root)
    plans = load_repository_ensembles(root)
    # `spare` is in no ensemble: preprocess serves it.
    assert python_models_of("preprocess", repository, plans) == ["augment", "decode", "spare"]
    assert python_models_of("postprocess", repository, plans) == ["softmax"]


def test_a_step_after_a_model_of_another_server_is_postprocess(tmp_path: Path) -> None:
    root = tmp_path / "repository"
    write_model(root, "pre", PYTHON, 'backend: "python"\n')
    write_model(root, "post", PYTHON, 'backend: "python"\n')
    # `remote` is not in this repository: some other server serves it.
    _ensemble(root, "chain", [("pre", "X", "a"), ("remote", "a", "b"), ("post", "b", "Y")])
    plans = load_repository_ensembles(root)
    assert python_models_of("preprocess", ModelRepository(root), plans) == ["pre"]
    assert python_models_of("postprocess", ModelRepository(root), plans) == ["post"]


def test_ensembles_that_disagree_leave_the_model_with_the_first(tmp_path: Path, caplog) -> None:
    root = tmp_path / "repository"
    write_model(root, "norm", PYTHON, 'backend: "python"\n')
    (root / "cnn" / "1").mkdir(parents=True)
    (root / "cnn" / "1" / "model.onnx").write_bytes(b"")
    _ensemble(root, "a_first", [("norm", "X", "a"), ("cnn", "a", "Y")])
    _ensemble(root, "b_second", [("cnn", "X", "a"), ("norm", "a", "Y")])
    plans = load_repository_ensembles(root)
    assert python_models_of("preprocess", ModelRepository(root), plans) == ["norm"]
    assert python_models_of("postprocess", ModelRepository(root), plans) == []
    assert "served by preprocess (give --load-model to choose)" in caplog.text


GPU_GROUP = 'backend: "python"\ninstance_group [ { count: 1, kind: KIND_GPU } ]\n'


def test_a_python_model_that_asks_for_gpus_is_the_model_services_and_what_follows_is_postprocess(
    tmp_path: Path,
) -> None:
    root = tmp_path / "repository"
    write_model(root, "tokenize", PYTHON, 'backend: "python"\n')
    write_model(root, "generate", PYTHON, GPU_GROUP)
    write_model(root, "detokenize", PYTHON, 'backend: "python"\n')
    write_model(root, "spare_gpu", PYTHON, GPU_GROUP)  # in no ensemble: still the model service's
    write_model(root, "spare", PYTHON, 'backend: "python"\ninstance_group [ { kind: KIND_CPU } ]\n')
    (root / "cnn" / "1").mkdir(parents=True)
    (root / "cnn" / "1" / "model.onnx").write_bytes(b"")
    _ensemble(root, "chain", [("tokenize", "X", "a"), ("generate", "a", "b"), ("detokenize", "b", "Y")])
    repository = ModelRepository(root)
    plans = load_repository_ensembles(root)
    assert python_models_of("preprocess", repository, plans) == ["spare", "tokenize"]
    assert python_models_of("model", repository, plans) == ["generate", "spare_gpu"]
    assert python_models_of("postprocess", repository, plans) == ["detokenize"]
    # The model service needs no ensembles: its models and the Python models that ask for GPUs.
    assert model_service_models(repository) == ["cnn", "generate", "spare_gpu"]
    # Where the ensembles cannot be read, a Python service serves every Python model but the model service's.
    assert unplaced_python_models(repository) == ["detokenize", "spare", "tokenize"]


def test_a_torchserve_archives_model_is_the_model_services(tmp_path: Path) -> None:
    """Its handler runs torch, which the model service's image has and the Python services' do not."""
    root = tmp_path / "repository"
    store = tmp_path / "store"
    archive_with_zipfile(store)
    write_store_models(LauncherModelStore(model_store=store, models="words.mar"), root)
    write_model(root, "spare", PYTHON, 'backend: "python"\n')
    repository = ModelRepository(root)
    assert python_models_of("preprocess", repository, []) == ["spare"]
    assert python_models_of("model", repository, []) == ["words"]
    assert model_service_models(repository) == ["words"]
    assert unplaced_python_models(repository) == ["spare"]


def test_a_split_handlers_methods_run_on_their_three_services(tmp_path: Path) -> None:
    """--split-handlers: preprocess on the preprocess service, inference on the model service (torch and the
    devices), postprocess on the postprocess service, as their ensemble's steps place them."""
    root = tmp_path / "repository"
    store = tmp_path / "store"
    archive_with_zipfile(store)
    write_store_models(
        LauncherModelStore(model_store=store, models="words.mar", split_handlers="words"), root
    )
    repository = ModelRepository(root)
    plans = load_repository_ensembles(root)
    assert [plan.name for plan in plans] == ["words"]
    assert python_models_of("preprocess", repository, plans) == ["words_preprocess"]
    assert python_models_of("model", repository, plans) == ["words_inference"]
    assert python_models_of("postprocess", repository, plans) == ["words_postprocess"]
    assert model_service_models(repository) == ["words_inference"]
