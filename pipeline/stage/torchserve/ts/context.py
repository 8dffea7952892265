"""What a TorchServe handler is handed with each batch: the model's properties and each request's headers,
and where it sets each answer's status, content type and headers."""

from __future__ import annotations

import os
from typing import Any


class RequestProcessor:
    """One request of a batch: its headers (and each form field's content type), and its answer's status and
    headers as the handler sets them."""

    def __init__(self, request_header: dict[str, Any]) -> None:
        self._status_code = 200
        self._reason_phrase: str | None = None
        self._response_header: dict[str, str] = {}
        self._request_header = request_header

    def get_request_property(self, key: str) -> Any:
        return self._request_header.get(key)

    def get_request_properties(self) -> dict[str, Any]:
        return self._request_header

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        self._status_code = code
        self._reason_phrase = reason_phrase

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str | None:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        return self._response_header.get(key)


class Context:
    """The model's properties (`manifest`, `system_properties`: model_dir, gpu_id, batch_size, ...) and, during
    a batch, its requests (`request_processor`, one per request)."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any] | None,
        batch_size: int,
        gpu: int | None,
        mms_version: str,
        limit_max_image_pixels: bool = True,
        metrics: Any = None,
        model_yaml_config: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest
        self._system_properties = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "MMS",
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
        }
        self.request_ids: dict[int, str] | None = None
        self._request_processor: list[RequestProcessor] | None = None
        self.metrics = metrics
        self.model_yaml_config = model_yaml_config or {}
        self.stopping_criteria = None
        self.header_key_sequence_id = os.getenv("TS_REQUEST_SEQUENCE_ID", "ts_request_sequence_id")
        self.header_key_sequence_start = os.getenv("TS_REQUEST_SEQUENCE_START", "ts_request_sequence_start")
        self.header_key_sequence_end = os.getenv("TS_REQUEST_SEQUENCE_END", "ts_request_sequence_end")

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    @property
    def request_processor(self) -> list[RequestProcessor] | None:
        return self._request_processor

    @request_processor.setter
    def request_processor(self, request_processor: list[RequestProcessor] | None) -> None:
        self._request_processor = request_processor

    def _request(self, idx: int) -> RequestProcessor:
        if self._request_processor is None:
            raise IndexError("no request is being handled")
        return self._request_processor[idx]

    def get_request_id(self, idx: int = 0) -> str | None:
        return None if self.request_ids is None else self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> Any:
        return self._request(idx).get_request_property(key)

    def get_all_request_header(self, idx: int) -> dict[str, Any]:
        return self._request(idx).get_request_properties()

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.get_response_headers(idx).get("content-type")

    def get_response_status(self, idx: int) -> tuple[int, str | None]:
        request = self._request(idx)
        return request.get_response_status_code(), request.get_response_status_phrase()

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        if self._request_processor is not None and self._request_processor[idx] is not None:
            self._request_processor[idx].report_status(code, reason_phrase=phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for request in self._request_processor or ():
            request.report_status(code, reason_phrase=phrase)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self._request(idx).get_response_headers()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self._request(idx).add_response_property(key, value)

    def get_sequence_id(self, idx: int) -> Any:
        return self._request(idx).get_request_property(self.header_key_sequence_id)
