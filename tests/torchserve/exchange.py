"""The requests of the TorchServe parity record, sent the same way to TorchServe 0.12 (`tests.torchserve.record`)
and to the pipeline (`tests/e2e/test_torchserve_parity.py`): the management API registers the word handler's
archive (`word_handler.py`), then the inference API is asked single requests of each kind, concurrent ones
with batching on, a batch with a request that raises, a missing model and version; the model is then scaled
and unregistered. Each answer is kept as its status, content type and body (a description keeps the fields
that do not depend on the run: not the workers' start times and process ids). `predictions` is the inference
part alone, for a server started with the models already loaded."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ANSWERS = HERE / "torchserve_answers.json"
#: The fields of a description compared (the others depend on the run or are TorchServe's internals).
DESCRIBED = (
    "modelName",
    "modelVersion",
    "modelUrl",
    "runtime",
    "minWorkers",
    "maxWorkers",
    "batchSize",
    "maxBatchDelay",
    "responseTimeout",
)
#: How many requests go at once in the concurrent case (the model's batch_size is 8).
CONCURRENT = 32

Answer = dict[str, Any]


def call(
    url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
) -> Answer:
    """One HTTP request; its status, content type and body (text)."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, content_type, data = (
                response.status,
                response.headers.get("Content-Type"),
                response.read(),
            )
    except urllib.error.HTTPError as err:
        status, content_type, data = err.code, err.headers.get("Content-Type"), err.read()
    return {"status": status, "content_type": content_type, "body": data.decode("utf-8", "replace")}


def described(answer: Answer) -> Answer:
    """A description's answer with only the fields compared."""
    if answer["status"] == 200:
        doc = json.loads(answer["body"])
        answer = {**answer, "body": [{key: model.get(key) for key in DESCRIBED} for model in doc]}
    return answer


def text(url: str, body: str, content_type: str = "text/plain") -> Answer:
    return call(url, "POST", body.encode(), {"Content-Type": content_type})


def form(url: str, fields: dict[str, str]) -> Answer:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in fields.items()
    ]
    body = ("".join(parts) + f"--{boundary}--\r\n").encode()
    return call(url, "POST", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


def at_once(calls: list[Callable[[], Answer]]) -> list[Answer]:
    """The calls made together (each on its own connection), answers in their order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda f: f(), calls))


def exchange(inference: str, management: str) -> dict[str, Any]:
    """Every request of the record, in order, against a server's inference and management base URLs."""
    predict = f"{inference}/predictions/words"
    answers: dict[str, Any] = {}
    register = f"{management}/models?url=words.mar&batch_size=8&max_batch_delay=200&initial_workers=1"
    answers["register"] = call(register + "&synchronous=true", "POST")
    answers["register_again"] = call(register + "&synchronous=true", "POST")
    answers["register_missing_archive"] = call(f"{management}/models?url=missing.mar", "POST")
    answers["register_without_url"] = call(f"{management}/models", "POST")
    pair = f"{management}/models?url=words.mar&model_name=pair&batch_size=2&max_batch_delay=5000&initial_workers=1"
    answers["register_pair"] = call(pair + "&synchronous=true", "POST")
    answers["list"] = call(f"{management}/models")
    answers["describe"] = described(call(f"{management}/models/words"))
    answers.update(predictions(inference))
    answers["scale"] = call(f"{management}/models/words?min_worker=2&max_worker=2&synchronous=true", "PUT")
    answers["describe_scaled"] = described(call(f"{management}/models/words"))
    answers["scale_missing"] = call(f"{management}/models/nope?min_worker=2", "PUT")
    answers["after_scale"] = text(predict, "still served")
    answers["unregister_missing_version"] = call(f"{management}/models/words/3.0", "DELETE")
    answers["unregister"] = call(f"{management}/models/words", "DELETE")
    answers["unregister_pair"] = call(f"{management}/models/pair/1.0", "DELETE")
    answers["unregister_missing"] = call(f"{management}/models/nope", "DELETE")
    answers["after_unregister"] = text(predict, "gone")
    answers["list_empty"] = call(f"{management}/models")
    return answers


#: The answers of `predictions`: those a server with the models `words` (batch_size 8, max_batch_delay 200)
#: and `pair` (batch_size 2, max_batch_delay 5000) of the word archive gives, however they were registered.
PREDICTIONS = (
    "ping",
    "text",
    "json",
    "octet_stream",
    "form",
    "get_empty",
    "answer_str",
    "answer_bytes",
    "answer_status",
    "answer_header",
    "raises",
    "version",
    "missing_version",
    "missing_model",
    "concurrent",
    "batch_with_raise",
)


def predictions(inference: str) -> dict[str, Any]:
    """The inference requests of the record (`PREDICTIONS`), in order."""
    predict = f"{inference}/predictions/words"
    answers: dict[str, Any] = {}
    answers["ping"] = call(f"{inference}/ping")
    answers["text"] = text(predict, "hello big world")
    answers["json"] = text(predict, json.dumps({"text": "a b c d"}), "application/json")
    answers["octet_stream"] = text(predict, "one two", "application/octet-stream")
    answers["form"] = form(predict, {"data": "hi there"})
    answers["get_empty"] = call(predict)
    answers["answer_str"] = text(predict, "str: shout this")
    answers["answer_bytes"] = text(predict, "bytes: as they are")
    answers["answer_status"] = text(predict, "status: set by the handler")
    answers["answer_header"] = text(predict, "header: and content type")
    answers["raises"] = text(predict, "raise now")
    answers["version"] = text(f"{predict}/1.0", "with its version")
    answers["missing_version"] = text(f"{predict}/2.0", "no such version")
    answers["missing_model"] = text(f"{inference}/predictions/nope", "no such model")
    sentences = [" ".join(["word"] * (1 + i % 7)) for i in range(CONCURRENT)]
    answers["concurrent"] = at_once([lambda s=s: text(predict, s) for s in sentences])
    # batch_size 2 and a long delay: the two requests make one batch, which the second fails.
    answers["batch_with_raise"] = at_once(
        [
            lambda: text(f"{inference}/predictions/pair", "fine words"),
            lambda: text(f"{inference}/predictions/pair", "raise"),
        ]
    )
    return answers
