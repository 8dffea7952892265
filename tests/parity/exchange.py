"""The fixed set of requests the parity check sends to a server serving the parity repository
(`tests.parity.lay_out`), with tritonclient over gRPC as Triton's users send them, and what the server
answered to each.

    python -m tests.parity.exchange HOST:PORT [REPOSITORY [HTTP_HOST:PORT METRICS_URL]]  # the answers as JSON

Each answer is {"outputs": {name: nested list}, "datatypes": {name: "FP32"}} or
{"error": {"status": "INVALID_ARGUMENT", "message": ...}}; with the server's HTTP/REST address and its
Prometheus `/metrics`, also the JSON of some HTTP/REST answers (`http_*`) and the lines of the models' own
metric families (`metrics_custom`: Triton's custom metrics).
Messages that name the served repository's folder say `<repository>` instead (REPOSITORY: that folder).
The requests run one after the other (a stream's requests in the order they were sent), so the answers are
the same on every run.
"""

from __future__ import annotations

import json
import queue
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

#: How long the idle sequence is left alone: longer than running_sum's max_sequence_idle_microseconds (2 s)
#: and the sequence batcher's time to notice it. (Every other sequence has its next request well within 2 s.)
IDLE_WAIT_S = 4.5


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value] if value.ndim else _plain(value.item())
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


class Exchange:
    def __init__(self, url: str, repository: str | None = None) -> None:
        self.client = triton.InferenceServerClient(url)
        self.repository = repository
        self.answers: dict[str, Any] = {}

    def _clean(self, value: Any) -> Any:
        """`value` with the served repository's folder written `<repository>` in its strings."""
        if isinstance(value, list):
            return [self._clean(v) for v in value]
        if isinstance(value, str) and self.repository:
            return value.replace(self.repository.rstrip("/"), "<repository>")
        return value

    def _error(self, exc: InferenceServerException) -> dict[str, Any]:
        status = str(exc.status() or "")
        return {
            "error": {
                "status": status.removeprefix("StatusCode."),
                "message": self._clean(exc.message() or ""),
            }
        }

    def _outputs(self, result: triton.InferResult) -> dict[str, Any]:
        outputs = sorted(result.get_response().outputs, key=lambda output: output.name)
        return {
            "outputs": {o.name: self._clean(_plain(result.as_numpy(o.name))) for o in outputs},
            "datatypes": {o.name: o.datatype for o in outputs},
        }

    def infer(
        self,
        case: str,
        model: str,
        inputs: dict[str, np.ndarray],
        outputs: list[str] | None = None,
        **options: Any,
    ) -> None:
        if outputs is not None:
            options["outputs"] = [triton.InferRequestedOutput(name) for name in outputs]
        tensors = []
        for name, array in inputs.items():
            tensor = triton.InferInput(name, list(array.shape), _datatype(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        try:
            answer = self._outputs(self.client.infer(model, tensors, **options))
        except InferenceServerException as exc:
            answer = self._error(exc)
        assert case not in self.answers, case
        self.answers[case] = answer

    def step(
        self,
        case: str,
        value: int,
        sequence_id: int | str,
        start: bool = False,
        end: bool = False,
        outputs: list[str] | None = None,
    ) -> None:
        self.infer(
            case,
            "running_sum",
            {"INPUT": np.array([[value]], np.int32)},
            outputs,
            sequence_id=sequence_id,
            sequence_start=start,
            sequence_end=end,
        )

    def http(self, case: str, address: str, path: str, body: Any = None) -> None:
        """The JSON a GET of `path` (a POST of `body`, where one is given) answers on the HTTP/REST port."""
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(
            urllib.request.Request(f"http://{address}{path}", data), timeout=30
        ) as reply:
            assert case not in self.answers, case
            self.answers[case] = json.loads(reply.read())

    def stream(self, case: str, sends: list[tuple[int, int, bool, bool]]) -> None:
        """Send (value, sequence id, start, end) requests on one stream; the answers by request, in order."""
        self.answers[case] = [self._outputs(result) for result in self._streamed("running_sum", sends)]

    def _streamed(self, model: str, sends: list[tuple[int, int, bool, bool]]) -> list[triton.InferResult]:
        """Send (value, sequence id, start, end) requests of `model` on one stream, all at once; the
        results by request, in order."""
        done: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: done.put((result, error)))
        try:
            for index, (value, sequence_id, start, end) in enumerate(sends):
                tensor = triton.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(np.array([[value]], np.int32))
                self.client.async_stream_infer(
                    model,
                    [tensor],
                    request_id=str(index),
                    sequence_id=sequence_id,
                    sequence_start=start,
                    sequence_end=end,
                )
            results: list[Any] = [None] * len(sends)
            for _ in sends:
                result, error = done.get(timeout=30)
                if error is not None:
                    raise AssertionError(f"stream: {error}")
                results[int(result.get_response().id)] = result
        finally:
            self.client.stop_stream()
        return results

    def batches(self, case: str, sequences: int, steps: int) -> None:
        """`sequences` sequences of `steps` requests each, interleaved and sent at once on one stream to
        `sequence_batches` (the oldest strategy): each sequence's totals, and how its batches formed: the
        inferences and executions its statistics count, and the executions of each size (from the batch size
        each request ran in), which the server's timing may change a little."""
        model = "sequence_batches"
        before = self._counts(model)
        sends = [
            (10 * sequence + step, 100 + sequence, step == 0, step == steps - 1)
            for step in range(steps)
            for sequence in range(sequences)
        ]
        results = self._streamed(model, sends)
        inferences, executions = (after - was for after, was in zip(self._counts(model), before, strict=True))
        totals: dict[str, list[int]] = {}
        sizes: dict[int, int] = {}
        for (_, sequence_id, _, _), result in zip(sends, results, strict=True):
            totals.setdefault(str(sequence_id), []).append(int(result.as_numpy("OUTPUT")[0, 0]))
            size = int(result.as_numpy("BATCH")[0, 0])
            sizes[size] = sizes.get(size, 0) + 1
        self.answers[case] = {
            "totals": totals,
            "inferences": inferences,
            "executions": executions,
            "batches": {str(size): count // size for size, count in sorted(sizes.items())},
        }

    def _counts(self, model: str) -> tuple[int, int]:
        """The inferences and executions a model's statistics count."""
        stats = self.client.get_inference_statistics(model, as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def _datatype(array: np.ndarray) -> str:
    return {"float32": "FP32", "int32": "INT32", "uint64": "UINT64"}[array.dtype.name]


def x(*rows: float) -> np.ndarray:
    return np.array([[r, r + 1, r + 2, r + 3] for r in rows], np.float32)


def custom_families(text: str, prefix: str) -> list[str]:
    """The lines of a Prometheus exposition that belong to the families named `prefix`...: their `# HELP`,
    `# TYPE` and samples, in the order written."""
    return [
        line
        for line in text.splitlines()
        if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(prefix)
    ]


def exchange(
    url: str,
    repository: str | None = None,
    *,
    http: str | None = None,
    metrics: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Send every request to the server at `url` (HTTP/REST ones to `http`, and read `metrics`, where given);
    the answers by case name."""
    ex = Exchange(url, repository)
    if http is not None and metrics is not None:
        _http_and_metrics(ex, http, metrics)

    # ---- BLS ----
    ex.infer("bls_exec", "bls_exec", {"X": x(1, 5)})
    # More calls at once than the callee's max_batch_size (8).
    ex.infer("bls_fan_out", "bls_fan_out", {"X": x(*range(0, 100, 10))})
    ex.infer("bls_fan_out_one", "bls_fan_out", {"X": x(7)})
    ex.infer("bls_fan_out_failing", "bls_fan_out_failing", {"X": x(1, 2, 3)})
    ex.infer("bls_report_ok", "bls_report_ok", {"X": x(1)})
    # A call asking for no output in particular gets them all (from a model that calls a model itself).
    ex.infer("bls_output_names", "bls_output_names", {"X": x(1)})
    # A call of more items than the callee's max_batch_size.
    ex.infer("bls_report_too_big", "bls_report_ok", {"X": x(*range(10))})
    # A call whose input the callee does not have.
    ex.infer("bls_report_wrong_input", "bls_report_wrong_input", {"X": x(1)})
    ex.infer("bls_report_raise", "bls_report_raise", {"X": x(1)})
    ex.infer("bls_report_error", "bls_report_error", {"X": x(1)})
    ex.infer("bls_report_missing", "bls_report_missing", {"X": x(1)})
    ex.infer("bls_reraise", "bls_reraise", {"X": x(1)})
    ex.infer("bls_forward", "bls_forward", {"X": x(1)})
    ex.infer("fail_raise", "fail_raise", {"X": x(1)})
    ex.infer("fail_error", "fail_error", {"X": x(1)})
    ex.infer("bls_exec_after_failures", "bls_exec", {"X": x(2)})
    # A model calling the sequence model as requests of a sequence (correlation_id and flags).
    for case, value, sequence_id, flags in (
        ("bls_sequence_start", 5, 77, 1),
        ("bls_sequence_next", 6, 77, 0),
        ("bls_sequence_end", 7, 77, 2),
        ("bls_sequence_no_start", 1, 78, 0),
    ):
        inputs: dict[str, np.ndarray] = {
            "VALUE": np.array([value], np.int32),
            "ID": np.array([sequence_id], np.uint64),
            "FLAGS": np.array([flags], np.int32),
        }
        ex.infer(case, "bls_sequence", inputs)

    # ---- priority ----
    # A batched model with two levels: a priority outside them (0, 3, 9) is its default level.
    for priority in (1, 2, 0, 3, 9):
        ex.infer(f"priority_{priority}", "add_one_ranked", {"X": x(priority)}, priority=priority)

    # ---- sequence batching ----
    # Two sequences, interleaved.
    ex.step("seq_11_start", 1, 11, start=True)
    ex.step("seq_22_start", 100, 22, start=True)
    ex.step("seq_11_second", 2, 11)
    ex.step("seq_22_second", 200, 22)
    ex.step("seq_11_end", 3, 11, end=True)
    ex.step("seq_22_third", 300, 22, outputs=["OUTPUT"])  # only the output asked for
    # A new sequence id without START; the ended sequence without START.
    ex.step("seq_33_no_start", 5, 33)
    ex.step("seq_11_after_end", 4, 11)
    # START again on a sequence that has not ended: it starts afresh.
    ex.step("seq_22_restart", 7, 22, start=True)
    ex.step("seq_22_end", 1, 22, end=True)
    ex.step("seq_11_again", 9, 11, start=True, end=True)
    # A sequence in one request (START and END), and a string id to a UINT64 CORRID.
    ex.step("seq_44_start_end", 6, 44, start=True, end=True)
    ex.step("seq_string_id", 1, "text", start=True)
    # No sequence id at all; two requests' worth (batch 2) in one request.
    ex.infer("seq_no_id", "running_sum", {"INPUT": np.array([[1]], np.int32)})
    ex.infer(
        "seq_batch_of_two",
        "running_sum",
        {"INPUT": np.array([[1], [2]], np.int32)},
        sequence_id=55,
        sequence_start=True,
    )
    # Five sequences interleaved on one stream: one more than max_candidate_sequences, so the last waits for
    # the first to end.
    sends = [
        (sequence * 10 + step, sequence, step == 0, step == 3)
        for step in range(4)
        for sequence in range(61, 66)
    ]
    ex.stream("seq_stream", sends)
    # A sequence left idle past max_sequence_idle_microseconds is released: its next request has no START.
    ex.step("seq_70_start", 1, 70, start=True)
    sleep(IDLE_WAIT_S)
    ex.step("seq_70_after_idle", 2, 70)
    ex.step("seq_70_restart", 3, 70, start=True, end=True)
    # A START that waits for a slot (all four held) longer than its request's timeout (µs) is answered
    # UNAVAILABLE, and its sequence forgotten; the sequences holding the slots go on.
    for sequence in (81, 82, 83, 84):
        ex.step(f"seq_{sequence}_holds_a_slot", 1, sequence, start=True)
    single = {"INPUT": np.array([[5]], np.int32)}
    options = {"sequence_id": 85, "sequence_start": True, "timeout": 200_000}
    ex.infer("seq_85_backlog_timeout", "running_sum", single, **options)
    ex.step("seq_85_after_timeout", 6, 85)
    for sequence in (81, 82, 83, 84):
        ex.step(f"seq_{sequence}_end", 2, sequence, end=True)
    # Six sequences of twelve requests sent at once on one stream, to the oldest strategy with a preferred
    # batch size of 4: Triton forms batches of 5 while its instance runs.
    ex.batches("seq_batches_stream", 6, 12)
    return ex.answers


def _http_and_metrics(ex: Exchange, http: str, metrics: str) -> None:
    # ---- custom metrics: two requests of parity_metrics (one of its two instances each, or both) ----
    for row in (2, 1):
        ex.infer(f"metrics_request_{row}", "parity_metrics", {"X": x(row)[0]})
    with urllib.request.urlopen(metrics, timeout=30) as reply:
        ex.answers["metrics_custom"] = custom_families(reply.read().decode(), "parity_")
    # ---- HTTP/REST JSON of a model that does not batch (max_batch_size 0, from auto_complete_config) ----
    ex.http("http_config_auto_nobatch", http, "/v2/models/auto_nobatch/config")
    ex.http("http_metadata_auto_nobatch", http, "/v2/models/auto_nobatch")
    ex.http("http_stats_auto_nobatch", http, "/v2/models/auto_nobatch/stats")
    ex.http("http_index", http, "/v2/repository/index", body={})


if __name__ == "__main__":
    grpc_url, *rest = sys.argv[1:]
    addresses = {"http": rest[1], "metrics": rest[2]} if len(rest) > 2 else {}
    print(json.dumps(exchange(grpc_url, rest[0] if rest else None, **addresses)))
