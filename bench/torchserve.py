"""One `.mar` served by `pipeline run --model-store` and by TorchServe 0.12, under the same load generator.

    python -m bench.torchserve [--torchserve-home TS_HOME] [--split] [--duration 10] [--warmup 2]
                               [--rounds 1] [--concurrency 1,8,32] [--loadgen FILE] [--out FILE]

The archive is `bench/torchserve_handler.py` (a `BaseHandler` subclass: UINT8 image bytes in, a fixed-seed CNN
on one torch thread, top-1 as JSON), made by TorchServe's `torch-model-archiver` where `--torchserve-home`
names TorchServe's environment (see `tests.torchserve.server`), else by `zipfile` in the same layout. Both
servers read the same TorchServe settings (`load_models` and the `models` JSON of a config.properties:
batch_size 32, max_batch_delay 5 ms, one worker) and are up together; each level of load is run on one, then
on the other, back to back (the order alternates by round). With `--split`, a second `pipeline run` serves
the same archive with its handler as three stages (`--split-handlers`: preprocess and postprocess on the CPU
services, inference on the model service), measured in the same turns as "pipeline split"; with the same load generator: `bench.http_load`,
or the peers' `loadgen/loadgen.py` (`--loadgen FILE`: it takes the same flags). Before the load, each server
is asked for the same image once and must answer 200 and the same body, byte for byte.

Each row (printed as a line of JSON, and written to `--out`): the server, the concurrency, requests/s, p50
and p99 in ms, errors, the CPU each request cost the server's processes (µs), the cores the load generator
and everything else on the machine used meanwhile (`foreign_cores`: this machine is shared), and for the
pipeline the mean batch its handler ran (items per execution, from the model's ModelStatistics; the split
form's inference model's). Then a table of the medians over rounds, the ratios to TorchServe, and the
targets: a mean batch of at least 8 at 32 clients, and at least TorchServe's throughput at each level.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.http_load import image
from bench.running import Pipeline, cpu_seconds, descendants
from tests.torchserve.archive import archive_with_archiver, archive_with_zipfile
from tests.torchserve.server import serve, version

HERE = Path(__file__).parent
HANDLER = HERE / "torchserve_handler.py"
MODEL = "images"
BATCH_SIZE = 32
MAX_BATCH_DELAY_MS = 5
#: The TorchServe settings both servers read.
PROPERTIES = (
    f"load_models={MODEL}.mar\n"
    + "models="
    + json.dumps(
        {
            MODEL: {
                "1.0": {
                    "defaultVersion": True,
                    "marName": f"{MODEL}.mar",
                    "minWorkers": 1,
                    "maxWorkers": 1,
                    "batchSize": BATCH_SIZE,
                    "maxBatchDelay": MAX_BATCH_DELAY_MS,
                    "responseTimeout": 120,
                }
            }
        }
    )
    + "\n"
)
#: The mean batch the pipeline should run at 32 clients.
MEAN_BATCH_TARGET = 8.0


class Server:
    """A server under test: its prediction URL and how to read the CPU its processes spent."""

    def __init__(self, name: str, url: str, root: int, statistics: str | None = None) -> None:
        self.name = name
        self.url = url
        self.root = root
        #: The model's statistics URL (the pipeline only).
        self.statistics = statistics

    def batches(self) -> tuple[int, int] | None:
        """The model's inference and execution counts so far (the pipeline only)."""
        if self.statistics is None:
            return None
        with urllib.request.urlopen(self.statistics, timeout=30) as response:
            (model,) = json.loads(response.read())["model_stats"]
        return int(model["inference_count"]), int(model["execution_count"])

    def cpu(self) -> float:
        total = 0.0
        for pid in descendants(self.root):
            try:
                total += cpu_seconds(pid)
            except OSError:
                continue  # a process that ended meanwhile
        return total


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def client_seconds() -> float:
    """CPU seconds this process's waited-for children spent: the load generator's."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ask(url: str, body: bytes, timeout: float = 180) -> bytes:
    """The answer to one prediction, once the model answers 200 (it may still be loading)."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/octet-stream"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return bytes(response.read())
        except (urllib.error.HTTPError, OSError) as err:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer 200: {err}") from None
            time.sleep(0.5)


def load(
    server: Server, concurrency: int, args: argparse.Namespace, out: Path, round_: int
) -> dict[str, Any]:
    """One level of load on `server`: the load generator's figures, with CPU and batches."""
    command = (
        [sys.executable, str(args.loadgen)] if args.loadgen else [sys.executable, "-m", "bench.http_load"]
    )
    command += ["--mode", "http", "--url", server.url, "--concurrency", str(concurrency)]
    command += ["--warmup", str(args.warmup), "--duration", str(args.duration), "--label", server.name]
    command += ["--json-out", str(out)]
    if args.loadgen:
        command += ["--quiet-wait", "0"]  # the machine is shared: it would rarely be quiet
    batches = server.batches()
    cpu, busy, client, start = server.cpu(), busy_seconds(), client_seconds(), time.monotonic()
    subprocess.run(command, check=True, timeout=args.warmup + args.duration + 180, cwd=HERE.parent)
    elapsed = time.monotonic() - start
    cpu, busy, client = server.cpu() - cpu, busy_seconds() - busy, client_seconds() - client
    (row,) = json.loads(out.read_text())
    requests = row["throughput"] * (args.warmup + args.duration)  # the warm-up's requests cost CPU too
    result = {
        "server": server.name,
        "concurrency": concurrency,
        "round": round_,
        "requests_per_s": row["throughput"],
        "p50_ms": row["p50_ms"],
        "p99_ms": row["p99_ms"],
        "completed": row["completed"],
        "errors": row["errors"],
        "first_error": row.get("first_error"),
        "cpu_us_per_request": cpu / requests * 1e6 if requests else None,
        "client_cores": client / elapsed,
        "foreign_cores": max(0.0, (busy - cpu - client) / elapsed),
    }
    if batches is not None and (after := server.batches()) is not None:
        executions = after[1] - batches[1]
        result["mean_batch"] = (after[0] - batches[0]) / executions if executions else None
    return result


def archive(store: Path, home: Path | None) -> tuple[Path, str]:
    """The benchmark's archive in `store`, and what made it."""
    if home is not None:
        archiver = home / "bin" / "torch-model-archiver"
        return archive_with_archiver(archiver, store, MODEL, HANDLER, ()), "torch-model-archiver"
    return archive_with_zipfile(store, MODEL, HANDLER, ()), "zipfile"


def start_pipeline(stack: ExitStack, work: Path, store: Path, split: bool) -> Server:
    """`pipeline run --model-store` serving the archive (its handler as three stages where `split`)."""
    flags = ["--model-store", str(store), "--ts-config", str(work / "models.properties")]
    flags += ["--split-handlers", MODEL] if split else []
    name = "pipeline split" if split else "pipeline"
    pipeline = Pipeline(flags, work / f"{name.replace(' ', '-')}.log")
    stack.callback(pipeline.stop)
    if pipeline.http is None:
        raise RuntimeError("`pipeline run` printed no HTTP address")
    batched = f"{MODEL}_inference" if split else MODEL
    url = f"{pipeline.http}/predictions/{MODEL}"
    return Server(name, url, pipeline.process.pid, f"{pipeline.http}/v2/models/{batched}/stats")


@contextmanager
def servers(work: Path, home: Path | None, split: bool) -> Iterator[list[Server]]:
    """The pipeline (and its split form where `split`), and TorchServe where `home` is given, serving the
    archive; stopped at the end."""
    store = work / "store"
    made_by = archive(store, home)[1]
    print(f"archive {MODEL}.mar made by {made_by}", file=sys.stderr, flush=True)
    (work / "models.properties").write_text(PROPERTIES)
    with ExitStack() as stack:
        found = [start_pipeline(stack, work, store, False)]
        if split:
            found.append(start_pipeline(stack, work, store, True))
        if home is not None:
            (work / "torchserve").mkdir()
            torchserve = stack.enter_context(serve(home, store, work / "torchserve", PROPERTIES))
            label = f"torchserve {version(home)}"
            found.append(Server(label, f"{torchserve.inference}/predictions/{MODEL}", torchserve.process.pid))
        answers = {server.name: ask(server.url, image()) for server in found}
        if len(set(answers.values())) != 1 or b'"label"' not in next(iter(answers.values())):
            raise RuntimeError(f"the servers answer the image differently: {answers}")
        print(f"every server answers {answers['pipeline']!r}", file=sys.stderr, flush=True)
        yield found


def measure(found: list[Server], args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for concurrency in args.concurrency:
        for round_ in range(args.rounds):
            for server in found if round_ % 2 == 0 else found[::-1]:
                out = work / f"{server.name.replace(' ', '-')}-c{concurrency}-r{round_}.json"
                row = load(server, concurrency, args, out, round_)
                print(json.dumps(row), flush=True)
                if args.out is not None:
                    with open(args.out, "a") as file:
                        file.write(json.dumps(row) + "\n")
                rows.append(row)
    return rows


def median(rows: list[dict[str, Any]], server: str, concurrency: int, key: str) -> float | None:
    values = [r[key] for r in rows if r["server"] == server and r["concurrency"] == concurrency]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(rows: list[dict[str, Any]], names: list[str], levels: list[int]) -> list[str]:
    """The table of medians over rounds, the ratios to TorchServe and the targets."""
    ours = [name for name in names if name.startswith("pipeline")]
    theirs = next((name for name in names if not name.startswith("pipeline")), None)
    header = " | ".join(f"{n} req/s, p50, p99 ms" for n in names)
    lines = ["", f"| clients | {header} | " + " | ".join(f"{n} ratio | {n} batch" for n in ours) + " |"]
    lines.append("|---" * (len(names) + 2 * len(ours) + 1) + "|")
    ratios: dict[tuple[str, int], float] = {}
    for c in levels:
        cells = []
        for name in names:
            rate, p50, p99 = (median(rows, name, c, key) for key in ("requests_per_s", "p50_ms", "p99_ms"))
            cells.append(f"{rate:,.0f}, {p50:.1f}, {p99:.1f}" if rate is not None else "-")
        for name in ours:
            rate = median(rows, name, c, "requests_per_s")
            base = median(rows, theirs, c, "requests_per_s") if theirs else None
            if base and rate is not None:
                ratios[name, c] = rate / base
            ratio = f"{ratios[name, c]:.2f}x" if (name, c) in ratios else "-"
            cells.append(f"{ratio} | {median(rows, name, c, 'mean_batch') or 0:.1f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    top = max(levels)
    for name in ours:
        batch = median(rows, name, top, "mean_batch") or 0.0
        met = "met" if batch >= MEAN_BATCH_TARGET else "NOT met"
        lines.append(
            f"\n{name}: mean batch at {top} clients: {batch:.1f} (target >= {MEAN_BATCH_TARGET:.0f}: {met})"
        )
    if ratios:
        for (name, c), ratio in ratios.items():
            verdict = "met" if ratio >= 1.0 else "NOT met"
            lines.append(f"{name} / TorchServe at {c} clients: {ratio:.2f}x (target >= 1.0x: {verdict})")
    else:
        lines.append("pipeline / TorchServe: not measured (no --torchserve-home)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.torchserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchserve-home", type=Path, default=None, help="TorchServe 0.12's venv")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per level and round")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each measure")
    parser.add_argument("--rounds", type=int, default=1, help="turns each server takes at each level")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[1, 8, 32],
        help="the levels of load: clients at once, comma-separated",
    )
    parser.add_argument(
        "--split", action="store_true", help="also serve the handler as three stages (--split-handlers)"
    )
    parser.add_argument("--loadgen", type=Path, default=None, help="the peers' loadgen/loadgen.py instead")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines here")
    args = parser.parse_args(argv)
    home = args.torchserve_home.resolve() if args.torchserve_home else None
    with (
        tempfile.TemporaryDirectory(prefix="bench-torchserve-") as folder,
        servers(Path(folder), home, args.split) as found,
    ):
        rows = measure(found, args, Path(folder))
        names = [server.name for server in found]
    print("\n".join(summary(rows, names, args.concurrency)))
    print(
        f"\n{os.cpu_count()} cores, shared: every figure was measured with the other server idle beside it; "
        "compare them as ratios within one run (foreign_cores says how busy the rest of the machine was)."
    )


if __name__ == "__main__":
    main()
