"""A sequence's running total of its INPUTs, kept by the model per correlation id: START resets it, END
drops it. It answers the total, the control inputs it saw (START, END, READY as 0/1), the CORRID control and
the request's flags and correlation id (request.flags(), request.correlation_id())."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:

            def get(name, request=request):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            corrid = int(get("CORRID").flat[0])
            correlation = request.correlation_id()  # a number (0 where the id is not one)
            correlation = correlation if isinstance(correlation, int) else 0
            start, end, ready = (
                bool(get("START").flat[0]),
                bool(get("END").flat[0]),
                bool(get("READY").flat[0]),
            )
            if start:
                self.totals[corrid] = 0
            if corrid not in self.totals:
                error = pb_utils.TritonError(f"running_sum has no total for sequence {corrid}")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            total = self.totals[corrid] + int(get("INPUT").flat[0])
            self.totals[corrid] = total
            if end:
                del self.totals[corrid]
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT", np.array([[total]], np.int32)),
                        pb_utils.Tensor("CONTROLS", np.array([[start, end, ready]], np.int32)),
                        pb_utils.Tensor("CORRID_OUT", np.array([[corrid]], np.uint64)),
                        pb_utils.Tensor("FLAGS", np.array([[request.flags()]], np.int32)),
                        pb_utils.Tensor("CORRELATION", np.array([[correlation]], np.uint64)),
                    ]
                )
            )
        return responses
