"""The model configuration reference (docs/reference/model-config.md): every top-level field of
`inference.ModelConfig`, from the descriptor the services parse `config.pbtxt` with, and what each kind of
model does with it, from `pipeline.protocol.config_fields` (the list the services log ignored fields by)."""

from __future__ import annotations

from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.docgen.page import cell, header
from pipeline.protocol import config_fields
from pipeline.protocol import model_config as rules
from services.model import backend as model_backend

_COLUMNS = {"ensemble": "ensemble", "python": "`model.py`", "model": "model file"}


def _use(field: config_fields.FieldUse | None, kind: str) -> str:
    if field is None or kind not in field.acted_on:
        return "ignored"
    return "differently" if field.differs else "yes"


def page() -> str:
    """The page's Markdown."""
    uses = {field.name: field for field in config_fields.FIELDS}
    unknown = sorted(uses.keys() - set(mc.ModelConfig.DESCRIPTOR.fields_by_name))
    if unknown:
        raise ValueError(f"pipeline.protocol.config_fields names fields ModelConfig has not: {unknown}")
    kinds = "\n".join(f"- **{_COLUMNS[kind]}**: {text}." for kind, text in config_fields.KINDS.items())
    lines = [
        "# Model configuration (`config.pbtxt`)",
        "",
        "A model's `config.pbtxt` is the text format of Triton's `inference.ModelConfig`",
        "(`protos/inference/model_config.proto`), read with protobuf's `text_format`: a syntax error or a field",
        "the message does not have refuses the model, naming the file, the line and the cause. Every field of the",
        "message is below, with what each kind of model does with it:",
        "",
        kinds,
        "",
        "**yes**: acted on as Triton does; **differently**: acted on, otherwise than Triton in a way the last",
        "section says; **ignored**: read, not acted on, and logged once at load, as a warning naming the file",
        "and the fields (the model loads):",
        "",
        "```text",
        rules.IGNORED_MESSAGE % ("<model>/config.pbtxt", "<field>, <field>"),
        "```",
        "",
        f"| field | {' | '.join(_COLUMNS.values())} | what it does here |",
        "|---|---|---|---|---|",
    ]
    for descriptor in mc.ModelConfig.DESCRIPTOR.fields:
        field = uses.get(descriptor.name)
        cells = [_use(field, kind) for kind in _COLUMNS]
        note = field.note if field is not None else "Not acted on by this server."
        lines.append(f"| `{descriptor.name}` | {' | '.join(cells)} | {cell(note)} |")
    lines += ["", "## Taken differently from Triton", ""]
    for field in config_fields.FIELDS:
        if field.differs:
            lines.append(f"- `{field.name}`: {field.differs}")
    return header("`pipeline.protocol.config_fields`") + "\n".join(lines) + "\n\n" + _parameters()


def _parameters() -> str:
    """The `parameters` keys this project gives a meaning to, from the constants that read them."""
    batching = ", ".join(f"`{key}`" for key in rules.BATCHING_PARAMETERS)
    runner = ", ".join(f"`{key}`" for key in model_backend.PARAMETER_KEYS)
    reported = f"`{model_backend.RUNNER_KEY}`, `{model_backend.REASON_KEY}`"
    lines = [
        "## `parameters` this server reads",
        "",
        "Any other key is passed to the model (a `Stage`'s `parameters`, a `TritonPythonModel`'s `args`).",
        "",
        "| key | kind | what it does |",
        "|---|---|---|",
        f"| `{rules.PAD_VALUE_PARAMETER}<TENSOR>` | every stage model | the value the router pads the tensor with "
        "to batch requests of different lengths ([Dynamic batching](../batching.md)) |",
        f"| {batching} | every stage model with `dynamic_batching` | the router's batching knobs Triton has no "
        "field for ([Dynamic batching](../batching.md#where-it-is-declared)) |",
        f'| `{rules.DETERMINISTIC_PARAMETER}` | every kind | `"false"`: never cache its responses '
        "([Response cache](../ensembles/cache.md)) |",
        f"| {runner} | model file | what runs the file, its threads, `torch.compile` "
        "([The model service](../serving/model-service.md#configpbtxt)) |",
        f"| {reported} | model file | written by the service into `ModelConfig`: what runs each instance, and why |",
        "| `optional_outputs`, `step.<N>.when`, `step.<N>.for_each`, `switch.<NAME>` | ensemble | what "
        "Triton's ensembles cannot say ([Triton's ensemble definition](../ensembles/triton-config.md)) |",
    ]
    return "\n".join(lines) + "\n"
