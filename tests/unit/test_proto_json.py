"""Protobuf messages as Triton's JSON: 64-bit integers as numbers everywhere, one rule for REST and the
Python backend's `initialize` config."""

import json

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import model_config_pb2 as mc
from pipeline.protocol.proto_json import message_json
from pipeline.stage.triton_model import triton_json


def _config() -> mc.ModelConfig:
    config = mc.ModelConfig(name="m", max_batch_size=8)
    config.input.add(name="X", data_type=mc.TYPE_FP32, dims=[3, -1])
    batching = config.dynamic_batching
    batching.max_queue_delay_microseconds = 500
    batching.priority_levels = 2
    # A map keyed by uint64 whose values hold 64-bit integers.
    batching.priority_queue_policy[1].default_timeout_microseconds = 1000
    batching.priority_queue_policy[2].max_queue_size = 7
    return config


def test_64_bit_integers_are_numbers_in_fields_lists_and_maps_keyed_by_integers() -> None:
    data = message_json(_config())
    assert data["max_batch_size"] == 8
    assert data["input"][0]["dims"] == [3, -1]
    batching = data["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 500
    assert batching["priority_levels"] == 2
    assert batching["priority_queue_policy"] == {
        "1": {"default_timeout_microseconds": 1000},
        "2": {"max_queue_size": 7},
    }


def test_a_map_of_64_bit_integer_values_is_converted() -> None:
    stats = pb.ModelStatistics(name="m", inference_count=3)
    stats.response_stats["0"].success.count = 5
    stats.response_stats["0"].success.ns = 12
    data = message_json(stats)
    assert data["inference_count"] == 3
    assert data["response_stats"] == {"0": {"success": {"count": 5, "ns": 12}}}


def test_every_field_mode_writes_defaults_as_numbers_too() -> None:
    # What Triton's Python backend hands to `initialize`: every field present, integers as numbers. The
    # python backend's copy of this rule used to fail on maps keyed by integers.
    data = triton_json(_config())
    assert data == message_json(_config(), every_field=True)
    assert data["dynamic_batching"]["priority_queue_policy"]["2"]["default_timeout_microseconds"] == 0
    assert isinstance(data["max_batch_size"], int)
    json.dumps(data)  # plain JSON, nothing left that json cannot write


def test_every_message_mode_writes_statistics_as_triton_does() -> None:
    # Triton 2.51's /v2/models/<model>/stats of a model nothing was asked of yet: every field, every duration.
    zero = {"count": 0, "ns": 0}
    stats = pb.ModelStatisticsResponse()
    stats.model_stats.add(name="m", version="1").batch_stats.add(batch_size=2)
    stats.model_stats[0].response_stats["0"].success.count = 1
    data = message_json(stats, every_message=True)
    (model,) = data["model_stats"]
    assert model["last_inference"] == model["inference_count"] == model["execution_count"] == 0
    assert model["inference_stats"] == {
        name: zero
        for name in (
            "success",
            "fail",
            "queue",
            "compute_input",
            "compute_infer",
            "compute_output",
            "cache_hit",
            "cache_miss",
        )
    }
    assert model["batch_stats"] == [
        {"batch_size": 2, "compute_input": zero, "compute_infer": zero, "compute_output": zero}
    ]
    assert model["response_stats"]["0"]["success"] == {"count": 1, "ns": 0}
    assert model["response_stats"]["0"]["empty_response"] == zero
    assert model["memory_usage"] == []
    assert not stats.model_stats[0].HasField("inference_stats")  # the message itself is left as it was
    # A model's configuration: zeros written, unset messages (a tensor's reshape, the batchers) not.
    config = message_json(
        mc.ModelConfig(name="nobatch", input=[mc.ModelInput(name="X", dims=[4])]), every_field=True
    )
    assert config["max_batch_size"] == 0 and "reshape" not in config["input"][0]
    assert "dynamic_batching" not in config and "sequence_batching" not in config
