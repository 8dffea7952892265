"""The interleaved side-by-side's summary: each round's figures, paired ratios, and the targets they meet."""

from __future__ import annotations

from bench.interleaved import summarise


def row(c: int, throughput: float, p50: float, cpu: dict[str, float], foreign: float = 0.5) -> dict:
    return {
        "concurrency": c,
        "throughput": throughput,
        "p50_ms": p50,
        "cpu_us_per_request": cpu,
        "foreign_cpu_cores": foreign,
    }


def rounds(figures: dict[int, list[tuple[float, float, dict[str, float]]]]) -> list[dict]:
    """Rows in the order an interleaved run makes them: round by round, level by level."""
    count = len(next(iter(figures.values())))
    return [row(c, *figures[c][r]) for r in range(count) for c in (1, 8, 32)]


def test_each_round_is_paired_with_the_same_round_of_the_others():
    pipeline_cpu = {"front": 100, "router": 200, "preprocess": 100, "model": 250, "postprocess": 50}
    ours = rounds(
        {
            1: [(100, 5.0, {}), (200, 4.0, {})],
            8: [(800, 10.0, {}), (600, 12.0, {})],
            32: [(1000, 30.0, {**pipeline_cpu, "all": 700}), (1500, 20.0, {**pipeline_cpu, "all": 600})],
        }
    )
    triton = rounds(
        {
            1: [(250, 2.0, {}), (250, 3.0, {})],
            8: [(400, 11.0, {}), (1000, 8.0, {})],
            32: [(1000, 27.0, {"all": 875}), (1200, 21.0, {"all": 750})],
        }
    )
    torchserve = rounds(
        {
            1: [(70, 10.0, {}), (90, 9.0, {})],
            8: [(350, 16.0, {}), (600, 12.0, {})],
            32: [(800, 28.0, {"all": 800}), (1250, 20.0, {"all": 550})],
        }
    )
    summary = summarise(
        {
            "floor": {"server_us": 400.0},
            "rows": {"pipeline": ours, "triton": triton, "torchserve": torchserve},
        }
    )
    assert (
        "| pipeline, compiled door | 100, 200 | 5.00, 4.00 | 800, 600 | 10.00, 12.00 | 1,000, 1,500 |"
        in summary
    )
    assert "pipeline / Triton, c=8: **2.00, 0.60**" in summary
    assert "c=32: **1.00, 1.25**" in summary
    assert "pipeline / TorchServe, c=32: **1.25, 1.20**" in summary
    # Front and router together against the bare server's 400 µs; the whole pipeline against Triton's.
    assert "(µs): 300, 300, against a bare grpc.aio server's 400 per call: **0.75, 0.75**" in summary
    assert "Triton's whole pipeline 875, 750: **0.80, 0.80**" in summary
    assert "front 100, router 200, preprocess 100, model 250, postprocess 50" in summary
