"""The Swarm controller against a Docker Engine API on a Unix socket (a small stand-in that answers the two
requests `docker service scale` makes): it reads a service's replicas, scales it up when the routers' queue
time is over target, refuses nothing silently, and counts each decision with its reason."""

from __future__ import annotations

import argparse
import json
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from pipeline.runtime.settings_cli import add_arguments
from pipeline.tools.scaling import Autoscaler, ScalingTargets
from pipeline.tools.swarm_autoscaler import (
    DockerError,
    DockerServices,
    ScaledService,
    SwarmAutoscaler,
    SwarmAutoscalerSettings,
    SwarmScaling,
    main,
    scaled_services,
    service_argument,
)


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        super().__init__(path, _Handler)
        self.services = {"pipeline_model": {"ID": "abc123", "Version": {"Index": 7}, "Spec": _spec(1)}}
        self.updates: list[tuple[str, dict]] = []


def _spec(replicas: int) -> dict:
    return {"Name": "pipeline_model", "Mode": {"Replicated": {"Replicas": replicas}}, "Labels": {}}


class _Handler(BaseHTTPRequestHandler):
    server: _Engine

    def log_message(self, format: str, *args: object) -> None:  # the client address of a Unix socket is ""
        pass

    def _answer(self, status: int, body: object) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        name = self.path.removeprefix("/services/")
        service = self.server.services.get(name)
        if service is None:
            self._answer(404, {"message": f"service {name} not found"})
            return
        self._answer(200, service)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        service = self.server.services["pipeline_model"]
        if self.path != f"/services/abc123/update?version={service['Version']['Index']}":
            self._answer(400, {"message": f"update out of sequence: {self.path}"})
            return
        self.server.updates.append((self.path, body))
        service["Spec"] = body
        service["Version"]["Index"] += 1
        self._answer(200, {"Warnings": None})


@pytest.fixture
def engine(tmp_path: Path):
    path = str(tmp_path / "docker.sock")
    server = _Engine(path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, path
    server.shutdown()
    server.server_close()


def _router_metrics(queue_sum: float, queue_count: int) -> str:
    return (
        "# TYPE pipeline_queue_duration_seconds histogram\n"
        f'pipeline_queue_duration_seconds_sum{{model="refcnn_cnn"}} {queue_sum}\n'
        f'pipeline_queue_duration_seconds_count{{model="refcnn_cnn"}} {queue_count}\n'
        "# TYPE pipeline_stage_model_replicas_ready gauge\n"
        'pipeline_stage_model_replicas_ready{stage="model",model="refcnn_cnn"} 1\n'
    )


def test_the_controller_scales_the_service_as_the_routers_queue_time_asks(engine):
    server, path = engine
    docker = DockerServices(path)
    scaled = ScaledService("model", "pipeline_model", Autoscaler(ScalingTargets(1, 3, cooldown=60.0)))
    controller = SwarmAutoscaler([scaled], docker, "unused:0")
    # First look: no queue time yet (a counter needs two looks), nothing in flight: it holds at 1.
    assert controller.look(0.0, [_router_metrics(0.0, 0)])["pipeline_model"].direction == "hold"
    # 100 requests waited 10 s in all since: 100 ms each, twice the target: 2 replicas.
    decision = controller.look(15.0, [_router_metrics(10.0, 100)])["pipeline_model"]
    assert (decision.replicas, decision.direction, decision.reason) == (2, "up", "queue_time")
    assert docker.replicas("pipeline_model") == 2
    path_sent, spec = server.updates[0]
    assert path_sent == "/services/abc123/update?version=7" and spec["Mode"]["Replicated"]["Replicas"] == 2
    # Quiet again: within the cool-down it holds at 2, and says why.
    decision = controller.look(30.0, [_router_metrics(10.0, 100)])["pipeline_model"]
    assert (decision.replicas, decision.direction, decision.reason) == (2, "hold", "cooldown")
    counted = controller.registry.get_sample_value(
        "pipeline_autoscaler_decisions_total", {"stage": "model", "direction": "up", "reason": "queue_time"}
    )
    assert counted == 1
    assert controller.registry.get_sample_value("pipeline_autoscaler_replicas", {"stage": "model"}) == 2


def test_a_refusal_of_the_engine_is_an_error_naming_it(engine):
    _, path = engine
    with pytest.raises(DockerError, match=r"404.*service nothing not found"):
        DockerServices(path).replicas("nothing")


def test_a_service_may_name_its_own_queue_time_target():
    assert service_argument("model=stack_model:1:4") == ("model", "stack_model", 1, 4, None)
    assert service_argument("preprocess=stack_pre:2:4:10") == ("preprocess", "stack_pre", 2, 4, 10.0)
    bad_ones = ("model=stack_model:1", "model=stack_model:1:4:fast", "model=stack_model:1:4:0", "=s:1:2")
    for bad in (*bad_ones, "model=stack_model:-1:4", "model=:1:2", "model=s:1:2:3:4"):
        with pytest.raises(argparse.ArgumentTypeError, match="STAGE=SERVICE:MIN:MAX"):
            service_argument(bad)


def test_its_settings_come_from_flags_else_the_environment(monkeypatch, capsys):
    """The controller's settings model: each setting from its flag, else its PIPELINE_AUTOSCALER_* variable
    (the Swarm stack's environment), else the default; without a service to scale it stops, saying so."""
    monkeypatch.setenv("PIPELINE_AUTOSCALER_SERVICES", "model=stack_model:1:4, preprocess=stack_pre:2:4:10")
    monkeypatch.setenv("PIPELINE_AUTOSCALER_QUEUE_MS", "80")
    parser = argparse.ArgumentParser()
    add_arguments(parser, SwarmAutoscalerSettings)
    settings = SwarmAutoscalerSettings.parse(parser, []).group(SwarmScaling)
    services = scaled_services(settings)
    assert [(s.stage, s.service) for s in services] == [("model", "stack_model"), ("preprocess", "stack_pre")]
    assert [s.autoscaler.targets.queue_seconds for s in services] == [0.08, 0.01]
    assert settings.interval == 15.0 and settings.routers == "tasks.router:8002"
    parser = argparse.ArgumentParser()
    add_arguments(parser, SwarmAutoscalerSettings)
    flagged = SwarmAutoscalerSettings.parse(parser, ["--service", "model=m:0:2", "--interval", "5"])
    assert flagged.group(SwarmScaling).service == [("model", "m", 0, 2, None)]
    assert flagged.group(SwarmScaling).interval == 5.0
    monkeypatch.setenv("PIPELINE_AUTOSCALER_SERVICES", "")
    with pytest.raises(SystemExit) as exit:
        main([])
    assert exit.value.code == 2 and "name a service to scale" in capsys.readouterr().err
