"""Fans out: one async_exec call to the model its `callee` parameter names per row of X, all in flight at once,
gathered in order; a call's error is raised."""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.callee = json.loads(args["model_config"])["parameters"]["callee"]["string_value"]

    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = [
                pb_utils.InferenceRequest(
                    model_name=self.callee,
                    inputs=[pb_utils.Tensor("X", x[i : i + 1])],
                    requested_output_names=["Y"],
                ).async_exec()
                for i in range(len(x))
            ]
            rows = []
            for reply in await asyncio.gather(*calls):
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
                rows.append(pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.concatenate(rows))]))
        return responses
