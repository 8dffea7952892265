"""Router workers' statistics summed into one `ModelStatistics` answer."""

from __future__ import annotations

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.router.workers import merge_statistics
from pipeline.runtime.model_statistics import ModelStats


def reply(*entries: tuple[str, ModelStats]) -> pb.ModelStatisticsResponse:
    return pb.ModelStatisticsResponse(model_stats=[stats.proto(name, "1") for name, stats in entries])


def test_counts_durations_and_batch_sizes_add_up_per_model():
    a, b, only_b = ModelStats(), ModelStats(), ModelStats()
    a.request_done(items=2, total_ns=100, queue_ns=10, compute_ns=50)
    a.batch_done(2, 50)
    b.request_done(items=3, total_ns=200, queue_ns=20, compute_ns=70)
    b.batch_done(3, 70)
    b.request_done(items=2, total_ns=300, queue_ns=30, compute_ns=80)
    b.batch_done(2, 80)
    b.request_failed(5)
    only_b.request_done(items=1, total_ns=1)
    merged = merge_statistics([reply(("e", a)), reply(("e", b), ("f", only_b))])
    e, f = merged.model_stats
    assert (e.name, f.name) == ("e", "f")
    assert e.inference_count == 7 and e.execution_count == 3
    assert (e.inference_stats.success.count, e.inference_stats.success.ns) == (3, 600)
    assert (e.inference_stats.queue.count, e.inference_stats.queue.ns) == (3, 60)
    assert (e.inference_stats.fail.count, e.inference_stats.fail.ns) == (1, 5)
    assert [(s.batch_size, s.compute_infer.count, s.compute_infer.ns) for s in e.batch_stats] == [
        (2, 2, 130),
        (3, 1, 70),
    ]
    assert f.inference_count == 1


def test_cache_lookups_and_a_decoupled_models_responses_add_up_too():
    a, b = ModelStats(), ModelStats()
    a.cache_hit_done(items=2, total_ns=40, cache_ns=10)
    a.cache_missed(5)
    b.cache_hit_done(items=1, total_ns=30, cache_ns=20)
    a.response_done(0, infer_ns=100, output_ns=1)
    b.response_done(0, infer_ns=200, output_ns=2)
    b.response_done(1, infer_ns=0, empty=True)
    (e,) = merge_statistics([reply(("e", a)), reply(("e", b))]).model_stats
    assert (e.inference_stats.cache_hit.count, e.inference_stats.cache_hit.ns) == (2, 30)
    assert (e.inference_stats.cache_miss.count, e.inference_stats.cache_miss.ns) == (1, 5)
    assert (e.response_stats["0"].compute_infer.count, e.response_stats["0"].compute_infer.ns) == (2, 300)
    assert e.response_stats["1"].empty_response.count == 1
    # What the cache answered, apart: a router adds it to a stage model's figures from its replicas.
    cached = a.cache_proto("e", "1")
    assert (cached.inference_count, cached.inference_stats.success.ns, cached.execution_count) == (2, 40, 0)
