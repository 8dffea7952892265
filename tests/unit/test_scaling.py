"""The scaling decision shared by `pipeline run --autoscale` and the Swarm controller: the HPAs' arithmetic,
up at once, down one at a time after the cool-down, within the bounds; and the routers' metrics read."""

from __future__ import annotations

import pytest

from pipeline.tools.scaling import (
    DOWN,
    HOLD,
    UP,
    Autoscaler,
    RouterSample,
    ScalingTargets,
    Signals,
    asks,
    signals_between,
    stage_samples,
)

TARGETS = ScalingTargets(minimum=1, maximum=4, cooldown=60.0)
IDLE = Signals(queue_seconds=0.001, queue_depth=0, inflight=0.2)


def test_each_signal_asks_as_an_hpa_computes_it():
    wanted = asks(TARGETS, Signals(queue_seconds=0.120, queue_depth=40, inflight=1.0), replicas=2)
    # 2 * 120/50 -> 5; 40/16 -> 3; 1.0/0.9 -> 2
    assert wanted == {"queue_time": 5, "queue_depth": 3, "inflight": 2}
    assert "queue_time" not in asks(TARGETS, Signals(None, 0, 0), replicas=1)
    queue_only = ScalingTargets(inflight_per_replica=0)
    assert asks(queue_only, Signals(0.01, 0, 1.0), replicas=1) == {"queue_time": 1, "queue_depth": 0}


def test_up_at_once_to_what_the_largest_ask_says_within_the_maximum():
    scaler = Autoscaler(TARGETS)
    decision = scaler.decide(Signals(0.120, 3, 1.0), replicas=1, now=0.0)
    assert (decision.replicas, decision.direction, decision.reason) == (3, UP, "queue_time")
    assert "queue time 120.0 ms" in decision.detail
    decision = scaler.decide(Signals(1.0, 100, 4.0), replicas=3, now=1.0)
    assert (decision.replicas, decision.direction) == (4, UP)


def test_down_one_at_a_time_only_after_the_cooldown():
    scaler = Autoscaler(TARGETS)
    assert scaler.decide(Signals(0.2, 0, 1.0), replicas=1, now=0.0).replicas == 4
    # Idle at once: held while the window still remembers the ask for 4 and the change is recent.
    for now in (1.0, 30.0, 59.0):
        decision = scaler.decide(IDLE, replicas=4, now=now)
        assert (decision.replicas, decision.direction, decision.reason) == (4, HOLD, "cooldown")
    decision = scaler.decide(IDLE, replicas=4, now=61.0)
    assert (decision.replicas, decision.direction, decision.reason) == (3, DOWN, "queue_time")
    # The next step down waits a whole cool-down again.
    assert scaler.decide(IDLE, replicas=3, now=62.0).direction == HOLD
    assert scaler.decide(IDLE, replicas=3, now=121.5).replicas == 2


def test_a_burst_within_the_window_keeps_the_replicas():
    scaler = Autoscaler(TARGETS)
    scaler.decide(Signals(0.2, 0, 1.0), replicas=1, now=0.0)
    scaler.decide(IDLE, replicas=4, now=70.0)  # down to 3 (the window forgot the first ask)
    scaler.decide(Signals(0.06, 0, 2.5), replicas=3, now=100.0)  # asks 4: up again
    for now in (101.0, 150.0):
        assert scaler.decide(IDLE, replicas=4, now=now).direction == HOLD


def test_bounds_hold_whatever_is_asked():
    scaler = Autoscaler(ScalingTargets(minimum=2, maximum=3, cooldown=0.0))
    decision = scaler.decide(IDLE, replicas=1, now=0.0)
    assert (decision.replicas, decision.direction, decision.reason) == (2, UP, "bounds")
    assert scaler.decide(Signals(5.0, 500, 9), replicas=3, now=1.0).direction == HOLD
    assert scaler.decide(IDLE, replicas=5, now=2.0).replicas == 3
    assert scaler.decide(IDLE, replicas=2, now=3.0).direction == HOLD
    with pytest.raises(ValueError, match="minimum <= maximum"):
        ScalingTargets(minimum=3, maximum=2)


ROUTER_METRICS = """\
# TYPE pipeline_queue_duration_seconds histogram
pipeline_queue_duration_seconds_bucket{model="refcnn_cnn",le="+Inf"} 10
pipeline_queue_duration_seconds_sum{model="refcnn_cnn"} 0.5
pipeline_queue_duration_seconds_count{model="refcnn_cnn"} 10
pipeline_queue_duration_seconds_sum{model="refcnn_pre"} 9.0
pipeline_queue_duration_seconds_count{model="refcnn_pre"} 3
# TYPE pipeline_queue_depth gauge
pipeline_queue_depth{model="refcnn_cnn"} 7
# TYPE pipeline_stage_inflight_calls gauge
pipeline_stage_inflight_calls{stage="model",replica="127.0.0.1:1"} 1
pipeline_stage_inflight_calls{stage="model",replica="127.0.0.1:2"} 0
pipeline_stage_inflight_calls{stage="preprocess",replica="127.0.0.1:3"} 4
# TYPE pipeline_stage_model_replicas_ready gauge
pipeline_stage_model_replicas_ready{stage="model",model="refcnn_cnn"} 2
pipeline_stage_model_replicas_ready{stage="preprocess",model="refcnn_pre"} 1
"""


def test_the_routers_metrics_summed_per_stage_and_their_mean_queue_time_between_looks():
    first = stage_samples([ROUTER_METRICS], ["model"])["model"]
    assert first == RouterSample(queue_sum=0.5, queue_count=10, queue_depth=7, inflight=1)
    # Two routers: everything adds up.
    both = stage_samples([ROUTER_METRICS, ROUTER_METRICS], ["model"])["model"]
    assert (both.queue_count, both.inflight) == (20, 2)
    later = RouterSample(queue_sum=2.5, queue_count=30, queue_depth=1, inflight=1)
    assert signals_between(first, later) == Signals(0.1, 1, 1)
    assert signals_between(None, later).queue_seconds is None
    assert signals_between(first, first).queue_seconds is None  # nothing queued since
    restarted = RouterSample(queue_sum=0.2, queue_count=4, queue_depth=0, inflight=0)
    assert signals_between(first, restarted).queue_seconds == pytest.approx(0.05)


def test_a_load_near_a_target_keeps_its_replicas_instead_of_flapping():
    """At 2 replicas, a queue of 10 asks for 1 at the target (16) but for 2 at half of it: no removal, however
    long it lasts; a queue of 6 would fit one replica at half the target, and one goes after the cool-down."""
    scaler = Autoscaler(TARGETS)
    scaler.decide(Signals(0.2, 20, 0.0), replicas=1, now=0.0)  # up to 4 (queue time)
    steady = Signals(0.010, 10, 0.0)
    for now in range(1, 300, 10):
        assert scaler.decide(steady, replicas=2, now=float(now)).replicas == 2
    decision = scaler.decide(Signals(0.010, 6, 0.0), replicas=2, now=300.0)
    assert (decision.replicas, decision.direction) == (2, HOLD)  # the window still holds the asks for 2
    assert scaler.decide(Signals(0.010, 6, 0.0), replicas=2, now=352.0).replicas == 1


def test_nothing_is_removed_before_a_whole_cooldown_of_looks():
    """A controller started beside a stage that has more replicas than it needs waits a whole cool-down of
    looks before removing one (it knows nothing of what was asked before it started)."""
    scaler = Autoscaler(TARGETS)
    for now in (0.0, 20.0, 59.0):
        assert scaler.decide(IDLE, replicas=3, now=now).direction == HOLD
    assert scaler.decide(IDLE, replicas=3, now=61.0).replicas == 2
