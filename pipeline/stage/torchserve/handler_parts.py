"""A `BaseHandler` split into three models (`pipeline run --split-handlers`): `<model>_preprocess` on the
preprocess service, `<model>_inference` on the model service, `<model>_postprocess` on the postprocess
service, joined by the archive's ensemble `<model>` (`pipeline.runtime.torchserve_store`). Each loads the
handler as TorchServe does (`initialize(context)`) and runs one of its methods on the batches the router
gathers for it, which need not be the batches of the method before: so the methods' results travel per
request (`pipeline.stage.torchserve.handler_values`), with each request's state beside them.

A request's state (`TS_STATE`) is its headers and the status, reason phrase and response headers the
handler has set on the context so far, so that every method sees the context TorchServe would give it; or,
once a method failed its batch, TorchServe's status and message for it. A failed request goes on through
the next models untouched (they run the others of their batch) and is answered with that error, as
TorchServe answers every request of a batch whose handler raised. Only a handler whose class keeps
`BaseHandler.handle` can be split: a handler that overrides `handle`, or a module-level function, does what
it does in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.protocol.errors import RepositoryError
from pipeline.runtime.torchserve_store import PARTS, pack, unpack
from pipeline.stage.torchserve.handler_service import HandlerService, failed, requests_of
from pipeline.stage.torchserve.handler_values import merge_rows, split_rows
from pipeline.stage.torchserve.ts.torch_handler.base_handler import BaseHandler

State = dict[str, Any]


class HandlerPart:
    """One of a split handler's three methods, run on batches of per-request elements."""

    def __init__(self, service: HandlerService, part: str) -> None:
        if part not in PARTS:
            raise RepositoryError(f"model '{service.name}': no handler method '{part}' ({', '.join(PARTS)})")
        handler = service.handler
        if not isinstance(handler, BaseHandler) or type(handler).handle is not BaseHandler.handle:
            kind = "a function" if handler is None else f"{type(handler).__name__}, which overrides handle"
            if handler is not None and not isinstance(handler, BaseHandler):
                kind = f"{type(handler).__name__}, which is no BaseHandler subclass"
            raise RepositoryError(
                f"model '{service.name}': its handler is {kind}; only a BaseHandler subclass that keeps "
                "BaseHandler.handle can run as three stages (leave it out of --split-handlers)"
            )
        self.service = service
        self.part = part
        self.method = getattr(handler, part)

    def run(self, inputs: Sequence[Sequence[bytes]]) -> list[list[bytes]]:
        """One batch: the part's inputs (per input tensor, an element per request) to its outputs (per output
        tensor): `TS_REQUEST` to `TS_DATA, TS_STATE` to `TS_DATA, TS_STATE` to `TS_RESPONSE`."""
        rows = inputs[0]
        data: list[dict[str, Any]] = []
        if self.part == PARTS[0]:
            data, headers = requests_of(rows)
            states: list[State] = [{"headers": header} for header in headers]
        else:
            states = [unpack(row)[0] for row in inputs[1]]
        good = [i for i, state in enumerate(states) if "error" not in state]
        results: list[bytes] = []
        if good:
            context = self.service.begin([states[i]["headers"] for i in good])
            for index, i in enumerate(good):
                processor = context.request_processor[index]  # type: ignore[index]
                processor.report_status(states[i].get("status", 200), states[i].get("phrase"))
                for key, value in states[i].get("response_headers", {}).items():
                    processor.add_response_property(key, value)
            try:
                value = data if self.part == PARTS[0] else merge_rows([rows[i] for i in good])
                results = self._results(self.method(value), len(good))
            except Exception as exc:
                error = self.service.failure(exc, f"its {self.part}")
                results = failed(len(good), *error) if self.part == PARTS[2] else []
                for i in good:
                    states[i] = {"status": error[0], "error": error[1]}
        return self._outputs(states, dict(zip(good, results, strict=False)))

    def _results(self, value: Any, count: int) -> list[bytes]:
        """The method's result for `count` requests: their answers (postprocess) or their elements."""
        if self.part == PARTS[2]:
            return self.service.answer(value, count)
        return split_rows(value, count, f"{self.part} of model '{self.service.name}'")

    def _outputs(self, states: list[State], results: dict[int, bytes]) -> list[list[bytes]]:
        """Every request's outputs: its result where it has one, else its failure carried on."""
        if self.part == PARTS[2]:
            return [
                [
                    results[i] if i in results else failed(1, state["status"], state["error"])[0]
                    for i, state in enumerate(states)
                ]
            ]
        context = self.service.context
        data, out_states = [], []
        position = 0
        for i, state in enumerate(states):
            if i not in results:
                data.append(b"")
                out_states.append(pack({"status": state["status"], "error": state["error"]}))
                continue
            status, phrase = context.get_response_status(position)
            headers = context.get_response_headers(position)
            position += 1
            data.append(results[i])
            out_states.append(
                pack(
                    {
                        "headers": state["headers"],
                        "status": status,
                        "phrase": phrase,
                        "response_headers": headers,
                    }
                )
            )
        return [data, out_states]
