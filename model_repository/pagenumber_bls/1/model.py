"""`pagenumber_bls`: the `pagenumber` ensemble as a Triton Python model that calls models (BLS).

Written for Triton's Python backend and served unmodified: `execute` is a coroutine, so that the digits CNN's
calls for every crop of a page are in flight at once (`async_exec`), where the router batches them with the
calls of every other page, as the ensemble's fan-out step does. A callee's error becomes this page's error.
"""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


def _outputs(response, names):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return [pb_utils.get_output_tensor_by_name(response, name) for name in names]


class TritonPythonModel:
    async def execute(self, requests):
        return [await self._page(request) for request in requests]

    async def _page(self, request):
        page = pb_utils.get_input_tensor_by_name(request, "PAGE")
        try:
            segmented = await pb_utils.InferenceRequest(
                model_name="pagenumber_segment", inputs=[page], requested_output_names=["CROPS"]
            ).async_exec()
            [crops] = _outputs(segmented, ["CROPS"])
            crops = crops.as_numpy()
            calls = [
                pb_utils.InferenceRequest(
                    model_name="digits_cnn",
                    inputs=[pb_utils.Tensor("INPUT", crops[i : i + 1])],
                    requested_output_names=["LOGITS"],
                ).async_exec()
                for i in range(len(crops))
            ]
            logits = [
                _outputs(response, ["LOGITS"])[0].as_numpy() for response in await asyncio.gather(*calls)
            ]
            joined = await pb_utils.InferenceRequest(
                model_name="pagenumber_join",
                inputs=[
                    pb_utils.Tensor(
                        "LOGITS", np.concatenate(logits) if logits else np.zeros((0, 10), np.float32)
                    )
                ],
                requested_output_names=["NUMBER", "DIGITS"],
            ).async_exec()
            return pb_utils.InferenceResponse(_outputs(joined, ["NUMBER", "DIGITS"]))
        except pb_utils.TritonModelException as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
