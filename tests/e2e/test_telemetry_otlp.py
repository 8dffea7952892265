"""OTLP export from a real service process, configured only by OpenTelemetry's environment variables.

The receiver is built here from the official protobuf definitions (`opentelemetry-proto`), on 127.0.0.1 and a
port the OS picks: a gRPC server implementing `TraceService/Export`, or an HTTP server taking OTLP/HTTP's
`POST /v1/traces` of a protobuf `ExportTraceServiceRequest`.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import request_for
from tests.e2e.conftest import start_service, wait_serving

pytestmark = pytest.mark.e2e

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span with its service name; `arrived` is set once the server span is in."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.arrived = threading.Event()
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append((attributes.get("service.name", ""), span))
                        if span.trace_id.hex() == TRACE_ID and span.name.startswith("ModelInfer"):
                            self.arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


def _http_receiver(servicer: Receiver) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            reply = servicer.Export(request, None).SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request):
    servicer = Receiver()
    if request.param == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        yield servicer, request.param, port
        server.stop(None)
    else:
        http = _http_receiver(servicer)
        thread = threading.Thread(target=http.serve_forever, daemon=True)
        thread.start()
        yield servicer, request.param, http.server_address[1]
        http.shutdown()
        http.server_close()


def test_a_stage_process_exports_its_spans_over_otlp(receiver, tmp_path):
    servicer, protocol, port = receiver
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "e2e",
        "PIPELINE_POSTPROCESS_METRICS_PORT": "off",
    }
    stage = start_service("postprocess", ["-m", "services.postprocess"], tmp_path, env=env)
    try:
        wait_serving(stage)
        logits = np.arange(20, dtype=np.float32).reshape(2, 10)
        metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
        with grpc.insecure_channel(stage.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            stub.ModelInfer(
                request_for("digits_postprocess", "otlp-1", LOGITS=logits), metadata=metadata, timeout=30
            )
        assert servicer.arrived.wait(60), "no span reached the OTLP receiver"
    finally:
        assert stage.stop() == 0
    ours = [(service, span) for service, span in servicer.spans if span.trace_id.hex() == TRACE_ID]
    assert {service for service, _ in ours} == {"e2e-postprocess"}
    by_name = {span.name: span for _, span in ours}
    assert {"ModelInfer digits_postprocess", "compute"} <= set(by_name)
    server_span = by_name["ModelInfer digits_postprocess"]
    assert server_span.parent_span_id.hex() == PARENT_ID
    assert by_name["compute"].parent_span_id == server_span.span_id
    attributes = {a.key: a.value for a in server_span.attributes}
    assert attributes["pipeline.request_id"].string_value == "otlp-1"
    assert attributes["pipeline.batch.size"].int_value == 2
