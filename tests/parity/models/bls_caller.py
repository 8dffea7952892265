"""Calls the model its `callee` parameter names and, as its `mode` parameter says, reports what the
call answered in its outputs ("report"), raises the callee's error message ("raise"), answers with the
callee's error ("forward"), asks for no output in particular and reports the names of the outputs it got
("names"), or names its input Z instead of X and reports what the call answered ("wrong_input")."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.callee = parameters["callee"]["string_value"]
        self.mode = parameters["mode"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            wanted = [] if self.mode == "names" else ["Y"]
            sent = pb_utils.Tensor("Z", x.as_numpy()) if self.mode == "wrong_input" else x
            call = pb_utils.InferenceRequest(
                model_name=self.callee, inputs=[sent], requested_output_names=wanted
            )
            reply = call.exec()
            if reply.has_error() and self.mode == "raise":
                raise pb_utils.TritonModelException(reply.error().message())
            if reply.has_error() and self.mode == "forward":
                responses.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            if reply.has_error():
                y = np.zeros_like(x.as_numpy())
                code, message = reply.error().code(), reply.error().message()
            else:
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                code, message = -1, ""
                if self.mode == "names":
                    message = ",".join(sorted(t.name() for t in reply.output_tensors()))
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("Y", y),
                        pb_utils.Tensor("HAS_ERROR", np.array([reply.has_error()], np.bool_)),
                        pb_utils.Tensor("CODE", np.array([code], np.int32)),
                        pb_utils.Tensor("MESSAGE", np.array([message.encode()], np.object_)),
                    ]
                )
            )
        return responses
