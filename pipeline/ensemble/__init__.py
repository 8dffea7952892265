"""Ensembles: loaded, validated, and compiled into the immutable plans the router runs.

Two front ends feed one compiler. An ensemble YAML file (`schema`) uses Triton's vocabulary: `inputs`,
`outputs` and `steps`, each step calling a stage model and mapping its tensors with `input_map` /
`output_map` (stage tensor name: ensemble tensor name). Stage endpoints are declared once under `stages` and
referred to by key; a step that names none is served by whichever of the router's stages serves its model.
Triton's own definition, a repository model's `config.pbtxt` with `platform: "ensemble"` and
`ensemble_scheduling`, becomes the same schema (`pbtxt`). Data dependencies define the DAG.

Validation happens in three layers, each raising `ConfigError` with the file, the step and the tensor:

1. the schema (pydantic, unknown keys rejected, values typed) - `loader.validate_ensemble`;
2. the graph (one producer per tensor, everything consumed is produced, no cycle) - `compiler`;
3. the stages' real signatures, learnt from `ModelMetadata` at start-up - `signatures.check_signatures`.

`catalog` gathers what the router serves (`load_catalog`) and checks what no single file can.
"""
