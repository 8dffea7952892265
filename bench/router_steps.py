"""Where the router's CPU per request goes: the same pipeline serving ensembles of the first 1, 2 and 3 of
refcnn's steps (preprocess; preprocess and model; the whole ensemble), each loaded in turn at 32 in flight by
the peers' load generator with the same input, the rounds interleaved. The router's (and the front's) CPU per
request at k steps is its door plus k steps, so the difference between two ensembles is what a step costs
it.

    python -m bench.router_steps --peers DIR [--front compiled] [--rounds 2] [--warmup 2] [--duration 8]

The one-step ensemble answers with the preprocessed pixels (48 KiB a request) where the others answer with
a few bytes: its row includes sending them back. The machine is shared and noisy: read the differences
within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from bench import peers
from bench.compare import ensemble_variant
from bench.running import Pipeline, per_request, wait_ready

#: The ensembles measured: steps taken from refcnn's, and the output the load generator asks for.
ENSEMBLES = {1: ("refcnn1", "pixels"), 2: ("refcnn2", "logits"), 3: ("refcnn", "LABEL")}
_OUTPUTS = {
    1: "{name: pixels, datatype: FP32, shape: [-1, 3, 64, 64]}",
    2: "{name: logits, datatype: FP32, shape: [-1, 10]}",
}


def write_ensembles(folder: Path) -> None:
    """Ensembles of refcnn's first one and two steps beside it in `folder`."""
    text = (folder / "refcnn" / "ensemble.yaml").read_text()
    head, steps = text[: text.index("outputs:")], text[text.index("  - model_name:") :]
    blocks = ["  - model_name:" + block for block in steps.split("  - model_name:")[1:]]
    for k in (1, 2):
        name = ENSEMBLES[k][0]
        body = head.replace("name: refcnn\n", f"name: {name}\n")
        body += f"outputs:\n  - {_OUTPUTS[k]}\nsteps:\n" + "".join(blocks[:k])
        (folder / name).mkdir()
        (folder / name / "ensemble.yaml").write_text(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_steps", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--peers", type=Path, required=True, help="shared/peers laid out and set up there")
    parser.add_argument(
        "--front", choices=("compiled", "python"), default="compiled", help="the router's door"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the three ensembles")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each measured interval")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per ensemble and round")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="router-steps-") as work:
        folder = ensemble_variant(Path(work) / "repository", True)
        write_ensembles(folder)
        running = Pipeline(folder, Path(work) / "pipeline.log", env={"PIPELINE_FRONT": args.front})
        try:
            for name, _ in ENSEMBLES.values():
                asyncio.run(wait_ready(running.router, name))
            found: dict[int, list[dict[str, float]]] = {k: [] for k in ENSEMBLES}
            for round_ in range(args.rounds):
                for k, (name, output) in ENSEMBLES.items():
                    before = running.cpu()
                    row = peers.loadgen(
                        args.peers,
                        "v2grpc",
                        running.router,
                        f"{name}, round {round_ + 1}",
                        Path(work) / f"{name}.{round_}.json",
                        args.warmup,
                        args.duration,
                        32,
                        "--model",
                        name,
                        "--input-name",
                        "IMAGE",
                        "--output-name",
                        output,
                    )
                    cpu = per_request(
                        before, running.cpu(), row["throughput"] * (args.warmup + args.duration)
                    )
                    found[k].append(cpu)
                    print(
                        f"   {k} step(s): cpu µs/request { {p: round(v) for p, v in cpu.items()} }",
                        flush=True,
                    )
        finally:
            running.stop()
    door = {
        k: statistics.mean(r.get("router", 0.0) + r.get("front", 0.0) for r in rows)
        for k, rows in found.items()
    }
    print("\nsteps | router | front | µs/request, the mean of the rounds (each round's router figure)")
    for k, rows in found.items():
        router = [r["router"] for r in rows]
        front = statistics.mean(r.get("front", 0.0) for r in rows)
        each = ", ".join(f"{v:.0f}" for v in router)
        print(f"{k} | {statistics.mean(router):.0f} | {front:.0f} | {each}")
    print(
        f"the model step adds {door[2] - door[1]:.0f} µs (its 48 KiB input through the router, less the one-step "
        f"ensemble's 48 KiB reply), the postprocess step {door[3] - door[2]:.0f} µs; the door and the first step "
        f"with its 48 KiB reply: {door[1]:.0f} µs (front and router together)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
