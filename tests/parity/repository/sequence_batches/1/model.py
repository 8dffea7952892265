"""A sequence's running total of its INPUTs (START resets it), and the size of the batch each request ran
in: how the oldest strategy formed its batches. Each batch takes 0.1 s, so that every request a stream sends
up front reaches the server while the first batch runs, and the batches form as the instance's pace has them
rather than as the requests happen to come (which a busy machine shifts)."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        time.sleep(0.1)
        responses = []
        for request in requests:

            def get(name, request=request):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().flat[0])

            corrid = get("CORRID")
            total = (0 if get("START") else self.totals.get(corrid, 0)) + get("INPUT")
            self.totals[corrid] = total
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT", np.array([[total]], np.int32)),
                        pb_utils.Tensor("BATCH", np.array([[len(requests)]], np.int32)),
                    ]
                )
            )
        return responses
