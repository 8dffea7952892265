"""The committed gRPC stubs are what protos/ generates (run `make protos` after editing a proto)."""

from pipeline.tools import codegen


def test_generated_stubs_are_fresh():
    wanted = codegen.generate()
    have = codegen.existing()
    stale = sorted(name for name in wanted.keys() | have.keys() if wanted.get(name) != have.get(name))
    assert not stale, f"stale generated stubs {stale}: run `make protos`"


def test_stubs_import_from_the_package_and_keep_proto_file_names():
    from pipeline._gen.inference import grpc_service_pb2, model_config_pb2

    assert grpc_service_pb2.DESCRIPTOR.name == "inference/grpc_service.proto"
    assert grpc_service_pb2.DESCRIPTOR.dependencies[0] is model_config_pb2.DESCRIPTOR
    assert "GRPCInferenceService" in grpc_service_pb2.DESCRIPTOR.services_by_name
