"""`textgen_detokenize`: token ids → text, written for Triton's Python backend.

Each row of `TOKEN` [N, K] is the ASCII codes of K characters (the generating step sends one per response);
id 0 stands for no character and is dropped. An id that is not ASCII (over 127) fails its request with
INVALID_ARG. The rows are independent, so the dynamic batcher may put rows of many streams in one call.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


def detokenize(tokens):
    """`tokens` [N, K] (ASCII codes, 0 for none) → [N, 1] BYTES, one string per row; `ValueError` naming
    the first id that is not ASCII."""
    rows = tokens.reshape(len(tokens), -1)
    bad = np.argwhere((rows < 0) | (rows > 127))
    if bad.size:
        row, column = (int(v) for v in bad[0])
        raise ValueError(f"TOKEN[{row}, {column}]: id {int(rows[row, column])} is not an ASCII code (0..127)")
    text = np.empty((len(rows), 1), dtype=np.object_)
    for i, row in enumerate(rows):
        text[i, 0] = row[row != 0].astype(np.uint8).tobytes()
    return text


class TritonPythonModel:
    """TOKEN [N, K] (INT64) → TEXT [N, 1] (BYTES)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKEN").as_numpy()
            try:
                text = detokenize(tokens)
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)]))
        return responses
