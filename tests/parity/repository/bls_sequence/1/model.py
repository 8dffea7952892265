"""Calls the sequence model running_sum with InferenceRequest.exec(), as a request of the sequence ID with the sequence flags
FLAGS (1: start, 2: end): its total, or -1 and the call's error message."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:

            def get(name, request=request):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            call = pb_utils.InferenceRequest(
                model_name="running_sum",
                inputs=[pb_utils.Tensor("INPUT", get("VALUE").reshape(1, 1))],
                requested_output_names=["OUTPUT"],
                correlation_id=int(get("ID")[0]),
                flags=int(get("FLAGS")[0]),
            )
            reply = call.exec()
            if reply.has_error():
                total, message = -1, reply.error().message()
            else:
                total, message = int(pb_utils.get_output_tensor_by_name(reply, "OUTPUT").as_numpy()[0, 0]), ""
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("TOTAL", np.array([total], np.int32)),
                        pb_utils.Tensor("MESSAGE", np.array([message.encode()], np.object_)),
                    ]
                )
            )
        return responses
