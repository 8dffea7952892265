"""`python -m services.model.train`: train `digits_cnn` and write it into a model repository."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from services.model.digits import DEFAULT_EPOCHS, train


def main(argv: Sequence[str] | None = None) -> None:
    """Train, then print the held-out accuracy and where the weights went."""
    parser = argparse.ArgumentParser(prog="python -m services.model.train", description=__doc__)
    parser.add_argument(
        "--out",
        "--model-dir",
        dest="out",
        default=os.environ.get("PIPELINE_MODEL_DIR", "models"),
        help="model repository to write into (env PIPELINE_MODEL_DIR; default %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="default %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument(
        "--version", default="1", help="version folder to write (a new one is served by RepositoryModelLoad)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if not args.version.isdigit() or int(args.version) < 1:
        parser.error("--version must be a positive integer")
    report = train(args.out, epochs=args.epochs, seed=args.seed, progress=args.progress, version=args.version)
    print(
        f"digits_cnn: held-out accuracy {report.test_accuracy:.2%} (train {report.train_accuracy:.2%}), "
        f"{report.epochs} epochs, seed {report.seed}, {report.seconds:.1f} s"
    )
    print(f"weights: {report.weights} (sha256 {report.sha256})")


if __name__ == "__main__":
    main()
