"""`pipeline bench`: load any Open Inference Protocol endpoint, gRPC or HTTP/REST, and report what it sustains.

In the spirit of Triton's perf_analyzer. Closed loop (`--concurrency 1,8,32`: N workers, each sending its next
request as soon as the previous one returns) or open loop (`--rate 500,1000`: arrivals at a set rate, Poisson
or evenly spaced, whether or not earlier requests have returned). Each level runs `--warmup` seconds, then is
measured for `--duration` seconds: a request counts in the interval when its response arrives inside it.

With `--stream` each request goes over a `ModelStreamInfer` stream of its own and may have many responses (a
decoupled model's, one per generated token): besides streams/s and the latency to a stream's last response,
the run reports responses/s, the time to first response and the gaps between one response and the next,
p50 and p99 (gRPC only).

Inputs are synthesised from the model's `ModelMetadata` (random data of each input's datatype and shape,
`--batch` items in the batch dimension) or read from files. The request is serialised once and the same bytes
are sent every time, and responses are counted but not decoded, so the generator stays cheap; `--processes`
spreads the load over several processes when one cannot keep up.

Where the server lists `statistics` in `ServerMetadata.extensions`, Triton's `ModelStatistics` is read before
and after each measured interval and the differences are reported per model: requests, executions, mean
batch size, queue wait and compute time. Elsewhere only the client's own figures are reported.

The modules, in the order a run uses them: `bench_settings` (the flags), `command` (the command), `options`
(what to measure, the levels), `endpoints` (the protocol's gRPC or HTTP/REST side), `payloads` (the inputs
and the request), `load` (one process's load), `processes` (the load processes), `statistics` (the server's
figures and process CPU), `progress` (the bar), `run` (a whole run) and `report` (the tables, JSON and the
plot).
"""
