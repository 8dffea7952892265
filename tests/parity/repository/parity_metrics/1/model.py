"""Custom metrics of each kind (pb_utils.MetricFamily), made by each of its two instances: one family and
series per name and labels. Y = X; each request counts once, sets the gauges and observes X's elements."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily
        self.requests_family = family(
            name="parity_requests", description="Requests executed", kind=family.COUNTER
        )
        self.requests = self.requests_family.Metric(labels={"version": "1", "model": "parity_metrics"})
        self.gauge_family = family(name="parity_last", description="The last request's X", kind=family.GAUGE)
        self.last_sum = self.gauge_family.Metric(labels={"of": "sum"})
        self.last_scaled = self.gauge_family.Metric(labels={"of": "sum_times_10000"})
        self.histogram_family = family(
            name="parity_values", description="X's elements", kind=family.HISTOGRAM
        )
        self.values = self.histogram_family.Metric(
            labels={"model": "parity_metrics"}, buckets=[1.0, 2.5, 10.0]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.requests.increment(1)
            self.last_sum.set(float(x.sum()))
            self.last_scaled.set(float(x.sum()) * 10000)
            for value in x.ravel():
                self.values.observe(float(value))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
