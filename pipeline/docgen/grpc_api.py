"""The gRPC reference (docs/reference/grpc.md), rendered from `protos/`: protoc (grpc_tools, as `make protos`
runs it) reads the files with their comments, and every service, RPC, message, field and enum is written out
with the comment above it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2 as d

from pipeline.docgen.page import cell, header, slug

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
#: Source-info path numbers (descriptor.proto's field numbers).
_MESSAGE, _SERVICE, _ENUM, _FIELD, _NESTED, _NESTED_ENUM, _METHOD, _VALUE = 4, 6, 5, 2, 3, 4, 2, 2
_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in d.FieldDescriptorProto.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def descriptors() -> list[d.FileDescriptorProto]:
    """The files under protos/, parsed by protoc with their comments."""
    from grpc_tools import protoc  # a build-time tool, as in `pipeline.tools.codegen`

    protos = sorted(str(path.relative_to(PROTO_ROOT)) for path in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "set.pb"
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", "--include_source_info", f"-o{out}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(protos)}")
        files = d.FileDescriptorSet.FromString(out.read_bytes()).file
    return [file for file in files if file.name in protos]


class _Comments:
    """The comments protoc kept for one file, by the path of what they describe."""

    def __init__(self, file: d.FileDescriptorProto) -> None:
        self.by_path = {
            tuple(location.path): " ".join(location.leading_comments.split())
            for location in file.source_code_info.location
        }

    def __call__(self, *path: int) -> str:
        return self.by_path.get(path, "")


def _type_name(field: d.FieldDescriptorProto, package: str) -> str:
    if field.type in (d.FieldDescriptorProto.TYPE_MESSAGE, d.FieldDescriptorProto.TYPE_ENUM):
        name = field.type_name.removeprefix(f".{package}.")
        return f"[`{name}`](#{slug(name)})" if not name.startswith(".") else f"`{name.lstrip('.')}`"
    return f"`{_SCALARS[field.type]}`"


def _field_type(field: d.FieldDescriptorProto, message: d.DescriptorProto, package: str) -> str:
    entry = next(
        (m for m in message.nested_type if m.options.map_entry and field.type_name.endswith(f".{m.name}")),
        None,
    )
    if entry is not None:
        key, value = entry.field
        return f"map of `{_SCALARS[key.type]}` to {_type_name(value, package)}"
    repeated = field.label == d.FieldDescriptorProto.LABEL_REPEATED
    return f"repeated {_type_name(field, package)}" if repeated else _type_name(field, package)


def _message(
    message: d.DescriptorProto, name: str, path: Sequence[int], comments: _Comments, package: str
) -> Iterator[str]:
    yield f"### `{name}`"
    yield ""
    if comment := comments(*path):
        yield comment
        yield ""
    if message.field:
        yield "| field | type | number | what it is |"
        yield "|---|---|---|---|"
        for index, field in enumerate(message.field):
            text = cell(comments(*path, _FIELD, index))
            yield f"| `{field.name}` | {_field_type(field, message, package)} | {field.number} | {text} |"
        yield ""
    for index, enum in enumerate(message.enum_type):
        yield from _enum(enum, f"{name}.{enum.name}", [*path, _NESTED_ENUM, index], comments)
    for index, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            yield from _message(nested, f"{name}.{nested.name}", [*path, _NESTED, index], comments, package)


def _enum(enum: d.EnumDescriptorProto, name: str, path: Sequence[int], comments: _Comments) -> Iterator[str]:
    yield f"### `{name}`"
    yield ""
    if comment := comments(*path):
        yield comment
        yield ""
    yield "| value | number | what it is |"
    yield "|---|---|---|"
    for index, value in enumerate(enum.value):
        yield f"| `{value.name}` | {value.number} | {cell(comments(*path, _VALUE, index))} |"
    yield ""


def _file(file: d.FileDescriptorProto) -> Iterator[str]:
    comments = _Comments(file)
    package = file.package
    yield f"## `{file.name}`"
    yield ""
    for s, service in enumerate(file.service):
        yield f"### `{package}.{service.name}`"
        yield ""
        if comment := comments(_SERVICE, s):
            yield comment
            yield ""
        yield "| RPC | request | response | what it does |"
        yield "|---|---|---|---|"
        for m, method in enumerate(service.method):
            request = _type_name(_as_field(method.input_type), package)
            response = _type_name(_as_field(method.output_type), package)
            request = f"stream {request}" if method.client_streaming else request
            response = f"stream {response}" if method.server_streaming else response
            yield f"| `{method.name}` | {request} | {response} | {cell(comments(_SERVICE, s, _METHOD, m))} |"
        yield ""
    for index, message in enumerate(file.message_type):
        yield from _message(message, message.name, [_MESSAGE, index], comments, package)
    for index, enum in enumerate(file.enum_type):
        yield from _enum(enum, enum.name, [_ENUM, index], comments)


def _as_field(type_name: str) -> d.FieldDescriptorProto:
    return d.FieldDescriptorProto(type=d.FieldDescriptorProto.TYPE_MESSAGE, type_name=type_name)


def page() -> str:
    """The page's Markdown."""
    lines = [
        "# gRPC API",
        "",
        "Every server here (the router, each stage service) serves `inference.GRPCInferenceService`: the Open",
        "Inference Protocol (KServe v2) with Triton's extensions, wire-compatible with Triton's",
        "`grpc_service.proto`, so Triton's clients, `perf_analyzer` and `grpcurl` talk to it, and stubs in any",
        "language come from these files (`protos/inference/`; `make protos` writes the Python ones into",
        "`pipeline/_gen`). Beside it, the standard `grpc.health.v1.Health` service answers health checks.",
        "What each server does with an RPC, and what it refuses, is on the pages of the features",
        "([Clients](../clients/index.md), [Managing models](../deployment/model-management.md)).",
        "",
    ]
    for file in sorted(descriptors(), key=lambda file: not file.service):  # the services first
        lines += list(_file(file))
    return header("`protos/`") + "\n".join(lines).rstrip() + "\n"
