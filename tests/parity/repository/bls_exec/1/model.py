"""Calls add_one with InferenceRequest.exec() and answers ten times its Y."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            call = pb_utils.InferenceRequest(model_name="add_one", inputs=[x], requested_output_names=["Y"])
            reply = call.exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y * 10)]))
        return responses
