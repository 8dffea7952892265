"""Fails by answering every request with an error response (INVALID_ARG)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        error = pb_utils.TritonError("fail_error is broken on purpose", pb_utils.TritonError.INVALID_ARG)
        return [pb_utils.InferenceResponse(error=error) for _ in requests]
