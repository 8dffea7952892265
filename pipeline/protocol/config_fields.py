"""Which top-level fields of `config.pbtxt` (`inference.ModelConfig`) each kind of model acts on, and how: the
one list the services log ignored fields by (`pipeline.protocol.model_config.log_ignored`) and the
documentation's model configuration reference is generated from (`python -m pipeline.docgen`).

A field that no entry names is ignored by every kind of model: logged at load, never refused. A field that
changes what a request means and is not served is refused where it is read (`iterative_sequence`, in
`pipeline.stage.sequence_config`), and its entry says so.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The kinds of model a repository holds, by who runs them: the router runs ensembles, the stage services
#: run `model.py` files (the python backend) and model files (the model service's backend).
KINDS = {
    "ensemble": 'an ensemble (`platform: "ensemble"`), run by the router',
    "python": "a `model.py` (Triton's Python backend or a `Stage`), run by a stage service",
    "model": "a model file (ONNX, TorchScript, `torch.export`, TensorRT), run by the model service",
}
_STAGES = frozenset({"python", "model"})
_ALL = frozenset(KINDS)


@dataclass(frozen=True)
class FieldUse:
    """How the servers take one top-level field of `ModelConfig`."""

    name: str
    #: The kinds of model (`KINDS`) that act on it; the others log it as ignored.
    acted_on: frozenset[str]
    #: What it does here.
    note: str
    #: Where it is taken otherwise than Triton takes it, how; empty where it is taken as Triton does.
    differs: str = ""


FIELDS: tuple[FieldUse, ...] = (
    FieldUse(
        "name",
        _ALL,
        "The model's name. Where given, it must be the folder's: a config naming another is refused.",
    ),
    FieldUse("platform", _ALL, "Chooses the backend with `backend`; `ensemble` makes the model an ensemble."),
    FieldUse(
        "backend",
        _ALL,
        "`python`, `onnxruntime`, `pytorch`, `tensorrt`: which service and backend run the model.",
    ),
    FieldUse(
        "version_policy",
        _STAGES,
        "Which numbered version folders are served: `latest` (default: the newest one), `all`, `specific`.",
    ),
    FieldUse(
        "max_batch_size",
        _ALL,
        "0: no batch dimension, `dims` are the whole shape; above 0, the largest batch the model takes.",
    ),
    FieldUse(
        "input",
        _ALL,
        "The inputs: `name`, `data_type`, `dims` (-1 where a dimension varies), `reshape`, `optional`.",
    ),
    FieldUse("output", _ALL, "The outputs: `name`, `data_type`, `dims`."),
    FieldUse(
        "instance_group",
        _STAGES,
        "`count` instances of `kind` `KIND_CPU`, `KIND_GPU` (on each of `gpus`) or `KIND_AUTO`, each on its "
        "own thread.",
        "A `KIND_GPU` group where no GPU is visible runs on the CPU, with a warning, instead of refusing the "
        "model. Replicas of a stage are processes (`--replicas`), not instances.",
    ),
    FieldUse(
        "default_model_filename",
        _STAGES,
        "The file in each version folder, instead of `model.onnx`, `model.pt`, `model.plan` or `model.py`.",
    ),
    FieldUse(
        "parameters",
        _ALL,
        "String parameters: those this project reads are listed below; the model sees them all.",
    ),
    FieldUse(
        "dynamic_batching",
        _STAGES,
        "The model's batching: every ensemble, BLS call and client request to the model shares one batcher.",
        "Run by the router, in front of the stage's replicas, not inside the stage; the knobs Triton has no "
        "field for are `parameters` (`pipeline.max_inflight_batches`, ...). Of `default_queue_policy`, "
        "`timeout_action` is not read (a request past its time is answered DEADLINE_EXCEEDED, as with REJECT), nor is "
        "`priority_queue_policy`.",
    ),
    FieldUse(
        "response_cache",
        _ALL,
        "`enable: true` caches whole responses in the router (`--cache-size`).",
        "The cache is the router's, in its memory: every replica's answers share it. A model whose "
        '`parameters` say `deterministic: "false"` is refused with it.',
    ),
    FieldUse(
        "ensemble_scheduling",
        frozenset({"ensemble"}),
        "The steps, as Triton writes them; conditions, switches and optional outputs go in `parameters`.",
        "Steps run as soon as their inputs exist, each batched by its model's own `dynamic_batching`; "
        "`max_inflight_requests` bounds a decoupled step's responses held by each later step.",
    ),
    FieldUse(
        "model_warmup",
        _STAGES,
        "Samples each instance runs before its version is reported ready (zero, random or file data).",
    ),
    FieldUse(
        "sequence_batching",
        _STAGES,
        "Stateful models: the `direct` and `oldest` strategies, control inputs and implicit state, run by "
        "the stage that holds the sequence; the router sends every request of a sequence to it.",
        "`iterative_sequence` is refused at load, naming it.",
    ),
    FieldUse(
        "model_transaction_policy",
        frozenset({"python"}),
        "`decoupled: true`: the model answers each request with any number of responses (streamed).",
    ),
    FieldUse(
        "optimization",
        frozenset({"model"}),
        "`execution_accelerators`: TensorRT on GPU instances (`precision_mode` `FP32` or `FP16`, "
        "`max_workspace_size_bytes`), `auto_mixed_precision` for PyTorch on CUDA.",
        "Only the GPU execution accelerators are read; `cuda`, `graph` and the priority are not.",
    ),
)


def acted_on(kind: str) -> frozenset[str]:
    """The top-level fields a kind of model (`KINDS`) acts on; a config's other fields are logged as ignored."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of model {kind!r} (expected one of {', '.join(KINDS)})")
    return frozenset(field.name for field in FIELDS if kind in field.acted_on)
