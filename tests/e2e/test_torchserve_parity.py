"""TorchServe's users move in: the word handler's archive (a hold-out custom `BaseHandler`, made by
`torch-model-archiver` where it is installed, else by `zipfile` in the same layout) served by `pipeline run
--model-store`, asked the parity requests (`tests.torchserve.exchange`) over TorchServe's APIs at the router's
HTTP port, answers as TorchServe 0.12 answered them (`tests/torchserve/torchserve_answers.json`, recorded by
`python -m tests.torchserve.record`): the same statuses and bodies, byte for byte, and the same content type
wherever TorchServe sends one (where it sends none, an HTTP server here sends application/octet-stream, the
RFC's default). Batching is checked through the model's statistics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.torchserve.archive import word_archive
from tests.torchserve.exchange import (
    ANSWERS,
    CONCURRENT,
    PREDICTIONS,
    Answer,
    call,
    exchange,
    predictions,
    text,
)

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def _pipeline_run(store: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`pipeline run --model-store store *flags`; yields the router's HTTP URL once it serves."""
    ports = ["--port", "0", "--http-port", "0", "--metrics-port", "off"]
    ports += ["--preprocess-port", "0", "--model-port", "0", "--postprocess-port", "0"]
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "run", "--model-store", str(store), *flags, *ports],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("pipeline: serving"):
                break
        else:
            raise AssertionError("pipeline run exited early:\n" + "".join(lines))
        yield re.search(r"(http://\S+) \(HTTP/REST\)", line).group(1)  # type: ignore[union-attr]
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(60)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    """`pipeline run --model-store` on a store holding the word archive; yields the router's HTTP URL."""
    store = tmp_path_factory.mktemp("store")
    word_archive(store)
    with _pipeline_run(store, env={**os.environ, "PIPELINE_MODEL_CONTROL_MODE": "explicit"}) as url:
        yield url


def _same(ours: Answer, theirs: Answer, what: str) -> None:
    assert (ours["status"], ours["body"]) == (theirs["status"], theirs["body"]), what
    if theirs["content_type"] is not None:
        assert ours["content_type"] == theirs["content_type"], what


def _same_answers(ours: Answer | list[Answer], theirs: Answer | list[Answer], name: str) -> None:
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), name
        for i, (mine, their) in enumerate(zip(ours, theirs, strict=True)):
            _same(mine, their, f"{name}[{i}]")
    else:
        assert isinstance(ours, dict), name
        _same(ours, theirs, name)


def test_answers_as_torchserve_does(served):
    recorded = json.loads(ANSWERS.read_text())
    assert recorded["version"] == "0.12.0"
    ours = exchange(served, served)
    assert list(ours) == list(recorded["answers"])
    for name, theirs in recorded["answers"].items():
        _same_answers(ours[name], theirs, name)


def test_concurrent_requests_are_batched(served):
    register = call(
        f"{served}/models?url=words.mar&model_name=batched&batch_size=32&max_batch_delay=500", "POST"
    )
    assert register["status"] == 200, register
    try:
        from tests.torchserve.exchange import at_once

        sentences = [" ".join(["w"] * (1 + i % 5)) for i in range(32)]
        answers = at_once([lambda s=s: text(f"{served}/predictions/batched", s) for s in sentences])
        assert [json.loads(a["body"])["words"] for a in answers] == [1 + i % 5 for i in range(32)]
        stats = json.loads(call(f"{served}/v2/models/batched/stats")["body"])["model_stats"][0]
        # 32 requests in far fewer executions: the handler saw batches of them.
        assert int(stats["inference_count"]) == 32
        assert int(stats["execution_count"]) <= 8, stats
    finally:
        call(f"{served}/models/batched", "DELETE")


def test_management_needs_model_control(tmp_path):
    """Without model control (TorchServe 0.12's enable_model_api=false), registering answers 405 as TorchServe
    does, and the archive is not left registered."""
    store = tmp_path / "store"
    word_archive(store)
    env = {key: value for key, value in os.environ.items() if key != "PIPELINE_MODEL_CONTROL_MODE"}
    with _pipeline_run(store, "--models", "words.mar", env=env) as url:
        # Served from start-up with --models, without any management call.
        assert json.loads(text(f"{url}/predictions/words", "two words")["body"])["words"] == 2
        refused = call(f"{url}/models?url=words.mar&model_name=other", "POST")
        assert refused["status"] == 405
        assert json.loads(refused["body"])["type"] == "MethodNotAllowedException"
        assert json.loads(call(f"{url}/models")["body"]) == {
            "models": [{"modelName": "words", "modelUrl": "words.mar"}]
        }


#: The record's two models of the word archive, loaded at start-up with the settings it registers them with.
RECORD_MODELS = {
    "words": {"batchSize": 8, "maxBatchDelay": 200},
    "pair": {"batchSize": 2, "maxBatchDelay": 5000},
}


def test_split_handler_answers_as_torchserve_does(tmp_path):
    """The word handler run as three stages (--split-handlers: preprocess, inference and postprocess as three
    models of three services, joined by an ensemble under the model's name) answers the record's predictions
    as TorchServe 0.12 did, byte for byte: a request whose preprocess raises fails its batch, the statuses and
    headers the handler sets come through, concurrent requests are batched by each model."""
    store = tmp_path / "store"
    word_archive(store)
    config = tmp_path / "config.properties"
    models = {name: {"1.0": settings} for name, settings in RECORD_MODELS.items()}
    config.write_text(f"models={json.dumps(models)}\n")
    flags = ["--models", "words=words.mar,pair=words.mar", "--ts-config", str(config)]
    env = {**os.environ, "PIPELINE_MODEL_CONTROL_MODE": "explicit"}
    with _pipeline_run(store, *flags, "--split-handlers", "words,pair", env=env) as url:
        ours = predictions(url)
        stats = {}
        for part in ("preprocess", "inference", "postprocess"):
            reply = json.loads(call(f"{url}/v2/models/words_{part}/stats")["body"])
            stats[part] = reply["model_stats"][0]
        # Scaled and unregistered as its three models; not registered again under its name.
        scaled = call(f"{url}/models/words?min_worker=2&synchronous=true", "PUT")
        assert scaled["status"] == 200, scaled
        assert json.loads(text(f"{url}/predictions/words", "after scaling")["body"])["words"] == 2
        assert call(f"{url}/models/words", "DELETE")["status"] == 200
        assert text(f"{url}/predictions/words", "gone")["status"] == 404
        again = call(f"{url}/models?url=words.mar&synchronous=true", "POST")
        assert again["status"] == 409 and "--split-handlers" in json.loads(again["body"])["message"]
    recorded = json.loads(ANSWERS.read_text())["answers"]
    assert list(ours) == list(PREDICTIONS)
    for name in PREDICTIONS:
        _same_answers(ours[name], recorded[name], name)
    # Each request the router took for "words" (11 single ones, then the concurrent ones) went through its
    # three models, the one that raised carried as failed after preprocess; the concurrent ones in batches.
    taken = 11 + CONCURRENT
    assert [int(stats[part]["inference_count"]) for part in stats] == [taken] * 3
    assert int(stats["inference"]["execution_count"]) <= 11 + CONCURRENT // 2, stats
