"""`textgen_tokenize`: ASCII prompts → token ids, written for Triton's Python backend.

A token id is the character's ASCII code, so no vocabulary is needed and each id is one whole character.
The prompts of a request ([N, 1]) come back as `PROMPT_IDS` [N, L], L the longest prompt, the shorter ones
padded with 0 (NUL), which the generating step skips and which text may not hold. A prompt that is not
ASCII, holds NUL or is longer than the `max_prompt_bytes` parameter fails its request with INVALID_ARG,
naming the prompt and the byte.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

#: The padding id (ASCII NUL).
PAD_ID = 0
DEFAULT_MAX_PROMPT_BYTES = 4096


def tokenize(prompts, max_bytes):
    """The token ids of `prompts` (an array of bytes), one row each, padded with `PAD_ID`; `ValueError`
    naming the first prompt that is not ASCII text without NUL or is longer than `max_bytes`."""
    rows = []
    for i, prompt in enumerate(prompts):
        data = bytes(prompt)
        if len(data) > max_bytes:
            raise ValueError(f"PROMPT[{i}]: {len(data)} bytes, the limit is {max_bytes}")
        ids = np.frombuffer(data, dtype=np.uint8)
        bad = np.flatnonzero((ids == PAD_ID) | (ids > 127))
        if bad.size:
            at = int(bad[0])
            raise ValueError(
                f"PROMPT[{i}]: byte 0x{ids[at]:02x} at {at} is not ASCII text (NUL excluded); "
                "this model reads ASCII only"
            )
        rows.append(ids)
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), PAD_ID, dtype=np.int64)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


class TritonPythonModel:
    """PROMPT [N, 1] (BYTES) → PROMPT_IDS [N, L] (INT64)."""

    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        value = parameters.get("max_prompt_bytes", {}).get("string_value", str(DEFAULT_MAX_PROMPT_BYTES))
        if not value.isdigit() or int(value) < 1:
            raise pb_utils.TritonModelException(
                f"parameter max_prompt_bytes must be an integer >= 1, got {value!r}"
            )
        self.max_prompt_bytes = int(value)

    def execute(self, requests):
        responses = []
        for request in requests:
            prompts = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy().reshape(-1)
            try:
                ids = tokenize(prompts, self.max_prompt_bytes)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PROMPT_IDS", ids)]))
        return responses
