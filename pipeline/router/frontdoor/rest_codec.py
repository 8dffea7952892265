"""The JSON codec of the Open Inference Protocol's REST API: request bodies to protobuf, and back.

An inference request's body becomes a `pb.ModelInferRequest` (every input as raw contents) and the form
each output is wanted in; a `pb.ModelInferResponse` becomes a body. Nothing here knows about HTTP
servers: `pipeline.router.frontdoor.http` serves what this decodes.

Binary tensor data (Triton's extension, what `tritonclient.http` sends by default): the body is a JSON
header of `Inference-Header-Content-Length` bytes followed by each input's raw bytes (`binary_data_size` in
its parameters), in order; outputs asked for with `binary_data: true` (or every output, with the request
parameter `binary_data_output: true`) come back the same way.

Limits hold before anything large is built: a body decompresses to at most the size limit, the tensors a
JSON input describes are counted (and their bytes weighed against the limit) before they are made, and a
JSON response is weighed before it is written (`max_json_bytes`), so a client is told to ask for binary
data instead of the server writing hundreds of megabytes of digits.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.datatypes import DATATYPES, element_count
from pipeline.protocol.errors import InvalidInput, ResourceExhausted, echo

#: The header that says how many bytes of the body are the JSON part (Triton's binary data extension).
HEADER_LENGTH = "Inference-Header-Content-Length"


# --- request decoding ----------------------------------------------------------------------------------


class BodyTooLarge(ResourceExhausted):
    """A request body, decompressed, or the tensors its JSON describes, larger than the server accepts (the
    HTTP side answers 413)."""


#: `Content-Encoding`s of request bodies, as Triton accepts them, and their zlib window bits.
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def check_encoding(encoding: str) -> str:
    """A request's `Content-Encoding`, normalised ("" for none); refuses one not supported."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return ""
    if encoding not in _ENCODINGS:
        raise InvalidInput(
            f"Content-Encoding '{echo(encoding, 20)}' is not supported (gzip, deflate or identity)"
        )
    return encoding


def decompressed(body: bytes, encoding: str, limit: int) -> bytes:
    """A request body as sent (`encoding` as `check_encoding` returns it) decompressed: at most `limit`
    bytes, whatever the ratio, and nothing after the end of the compressed data."""
    if not encoding:
        return body
    decoder = zlib.decompressobj(_ENCODINGS[encoding])
    try:
        data = decoder.decompress(body, limit + 1)  # NOTE: never more than the limit, whatever the ratio
    except zlib.error as err:
        raise InvalidInput(f"the request body is not valid Content-Encoding {encoding}: {err}") from None
    if len(data) > limit:
        raise BodyTooLarge(body_too_large(limit))
    if not decoder.eof:
        raise InvalidInput(f"the request body is not valid Content-Encoding {encoding}: it is truncated")
    if decoder.unused_data:
        raise InvalidInput(
            f"the request body is not valid Content-Encoding {encoding}: {len(decoder.unused_data)} bytes "
            f"follow after the end of the {encoding} data"
        )
    return data


def body_too_large(limit: int) -> str:
    """What a client whose request body is over the limit is told."""
    return f"the request body is larger than this server accepts ({limit} bytes, --max-message-mb)"


@dataclass(frozen=True, slots=True)
class OutputForm:
    """How the client wants each output: as binary data (True) or as JSON (False)."""

    default: bool
    asked: Mapping[str, bool]

    def binary(self, name: str) -> bool:
        return self.asked.get(name, self.default)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON part of a request body and the binary data after it."""
    if header_length is None:
        return body, memoryview(b"")
    length = _byte_count(header_length)
    if length is None:
        raise InvalidInput(f"{HEADER_LENGTH} must be a number of bytes, got '{echo(header_length, 40)}'")
    if length > len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the request body has {len(body)} bytes")
    return body[:length], memoryview(body)[length:]


def json_part_size(body_size: int, header_length: str | None) -> int:
    """The bytes of a request body's JSON part: all of it, or what `Inference-Header-Content-Length` says
    (0 when that is no number of bytes of the body, which `infer_request` refuses before any parsing)."""
    if header_length is None:
        return body_size
    length = _byte_count(header_length)
    return length if length is not None and length <= body_size else 0


def _byte_count(text: str) -> int | None:
    """A header's number of bytes, None when it is none: ASCII digits only (Python's int() would also take
    "+5", "1_0" and other scripts' digits, "３０"), and at most 18 of them (int() refuses thousands)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        return None
    return int(text)


def json_object(text: bytes, what: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidInput(f"the {what} is JSON nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise InvalidInput(f"the {what} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"the {what} must be a JSON object, got {type(value).__name__}")
    return value


def json_field(obj: Mapping[str, Any], key: str, kind: type, what: str, default: Any) -> Any:
    """`obj[key]` when it is of `kind` (a JSON boolean is no integer), `default` when absent."""
    value = obj.get(key, default)
    if value is default:
        return value
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidInput(f"{what}: '{key}' must be {_JSON_KINDS[kind]}, got {json.dumps(value)[:60]}")
    return value


_JSON_KINDS = {list: "a list", dict: "an object", str: "a string", bool: "a boolean", int: "an integer"}


def _parameter(key: str, value: Any, what: str) -> pb.InferParameter:
    """A JSON parameter value as the protocol's `InferParameter`."""
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return pb.InferParameter(int64_param=value)
        if 0 <= value < 2**64:
            return pb.InferParameter(uint64_param=value)
        raise InvalidInput(f"{what}: parameter '{key}' is outside the 64-bit integer range")
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    if isinstance(value, str):
        return pb.InferParameter(string_param=value)
    raise InvalidInput(f"{what}: parameter '{key}' must be a boolean, number or string")


def _copy_parameters(
    target: Any, parameters: Mapping[str, Any], what: str, skip: frozenset[str] = frozenset()
) -> None:
    for key, value in parameters.items():
        if key not in skip:
            target[key].CopyFrom(_parameter(key, value, what))


def _shape(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise InvalidInput(f"{what}: 'shape' must be a list of integers, got {json.dumps(value)[:60]}")
    if any(d < 0 for d in value):
        raise InvalidInput(f"{what}: shape {value} has a negative dimension")
    if any(d >= 2**63 for d in value):
        raise InvalidInput(f"{what}: shape {value} has a dimension beyond the 64-bit range")
    return value


def _json_tensor_raw(name: str, datatype: str, shape: list[int], data: Any, budget: int) -> bytes:
    """The raw bytes of an input sent as JSON `data` (flat or nested, row-major): refused before they are
    made when the data's count disagrees with the shape, or they would be more than `budget` bytes."""
    what = f"input '{echo(name)}'"
    if not isinstance(data, list):
        raise InvalidInput(f"{what}: 'data' must be a list, got {json.dumps(data)[:60]}")
    count = element_count(shape)
    # A BYTES element takes at least its 4-byte length prefix.
    size = count * (4 if datatype == "BYTES" else DATATYPES[datatype].itemsize)
    if size > budget:
        raise BodyTooLarge(
            f"{what}: {datatype} shape {shape} is {size} bytes, more than the {budget} bytes left of what a "
            "request may carry here (--max-message-mb)"
        )
    found = _data_count(data)
    if found != count:
        raise InvalidInput(f"{what}: shape {shape} needs {count} elements, 'data' has {found}")
    if datatype == "BYTES":
        try:
            elements = np.array(data, dtype=object).reshape(-1)
        except ValueError as err:
            raise InvalidInput(f"{what}: 'data' is not a regular array: {err}") from None
        if not all(isinstance(e, str) for e in elements):
            raise InvalidInput(f"{what}: BYTES data in JSON must be strings")
        array = elements
    else:
        try:
            array = np.asarray(data)
        except (ValueError, OverflowError) as err:
            raise InvalidInput(f"{what}: 'data' is not a regular array of numbers: {err}") from None
        if array.size:
            _check_kind(array, datatype, what)
    if array.size != count:
        raise InvalidInput(f"{what}: shape {shape} needs {count} elements, 'data' has {array.size}")
    if datatype == "BYTES":
        try:
            shaped = array.reshape(shape)
        except ValueError as err:  # no elements, but a shape numpy cannot hold: [0, 2**62]
            raise InvalidInput(f"{what}: shape {shape} cannot be held: {err}") from None
        return Tensor.from_array(name, shaped).raw
    return np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()


def _data_count(data: list[Any]) -> int:
    """The elements of JSON `data` as its first entry at each depth says (numpy then checks that the others
    agree): counted without building anything."""
    count, level = 1, data
    while isinstance(level, list):
        count *= len(level)
        if not level:
            break
        level = level[0]
    return count


def _check_kind(array: np.ndarray, datatype: str, what: str) -> None:
    """Refuse JSON values that the datatype cannot hold: no silent truncation or wrap-around."""
    dtype = DATATYPES[datatype]
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}.get(dtype.kind, "iuf")
    if array.dtype.kind not in kinds:
        raise InvalidInput(f"{what}: {datatype} data must be {_KIND_WORDS[dtype.kind]}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise InvalidInput(f"{what}: data has values outside the range of {datatype}")


_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers", "V": "numbers"}


def infer_request(
    body: bytes, header_length: str | None, model: str, version: str, max_input_bytes: int = 0
) -> tuple[pb.ModelInferRequest, OutputForm]:
    """A REST inference request as the protocol's `ModelInferRequest` (every input as raw contents), and
    the form each output is wanted in. Its inputs may hold at most `max_input_bytes` (0: no limit)."""
    try:
        return _infer_request(body, header_length, model, version, max_input_bytes or sys.maxsize)
    except UnicodeEncodeError as err:  # JSON may escape lone surrogates, which no UTF-8 string can hold
        raise InvalidInput(
            f"the request holds a string that is not valid Unicode: {err.object[err.start : err.end]!r} "
            "(a lone surrogate)"
        ) from None


def _infer_request(
    body: bytes, header_length: str | None, model: str, version: str, budget: int
) -> tuple[pb.ModelInferRequest, OutputForm]:
    text, binary = _split_body(body, header_length)
    doc = json_object(text, "request body" if header_length is None else "JSON header of the request")
    what = "request"
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    request.id = json_field(doc, "id", str, what, "")
    parameters = json_field(doc, "parameters", dict, what, {})
    _copy_parameters(request.parameters, parameters, what, frozenset({"binary_data_output"}))
    default_binary = json_field(parameters, "binary_data_output", bool, "request parameters", False)
    inputs = json_field(doc, "inputs", list, what, None)
    if inputs is None:
        raise InvalidInput("the request has no 'inputs'")
    offset = 0
    budget -= len(binary)
    for index, entry in enumerate(inputs):
        raw, size = _input(request, index, entry, binary, offset, budget)
        request.raw_input_contents.append(raw)
        if size is None:
            budget -= len(raw)
        else:
            offset += size
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary)} bytes of binary data follow the JSON header ({HEADER_LENGTH}), but the "
            f"inputs' binary_data_size add up to {offset}"
        )
    asked: dict[str, bool] = {}
    for index, entry in enumerate(json_field(doc, "outputs", list, what, [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidInput(f"outputs[{index}] must be a JSON object with a 'name'")
        where = f"output '{echo(entry['name'])}'"
        params = json_field(entry, "parameters", dict, where, {})
        asked[entry["name"]] = json_field(params, "binary_data", bool, f"{where} parameters", default_binary)
        output = request.outputs.add(name=entry["name"])
        _copy_parameters(output.parameters, params, where, frozenset({"binary_data"}))
    return request, OutputForm(default_binary, asked)


def _input(
    request: pb.ModelInferRequest, index: int, entry: Any, binary: memoryview, offset: int, budget: int
) -> tuple[bytes, int | None]:
    """Add `inputs[index]` of a request body to `request`; return its raw contents and, for binary data, its
    `binary_data_size` (its bytes begin at `offset` of `binary`; None for JSON data, at most `budget` bytes)."""
    if not isinstance(entry, dict):
        raise InvalidInput(f"inputs[{index}] must be a JSON object")
    name = json_field(entry, "name", str, f"inputs[{index}]", None)
    if name is None:
        raise InvalidInput(f"inputs[{index}] has no 'name'")
    where = f"input '{echo(name)}'"
    datatype = json_field(entry, "datatype", str, where, None)
    if datatype not in DATATYPES:
        raise InvalidInput(
            f"{where}: unknown datatype '{echo(str(datatype), 20)}' (expected one of {', '.join(DATATYPES)})"
        )
    shape = _shape(entry.get("shape"), where)
    params = json_field(entry, "parameters", dict, where, {})
    size = json_field(params, "binary_data_size", int, f"{where} parameters", None)
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    _copy_parameters(tensor.parameters, params, where, frozenset({"binary_data_size"}))
    if size is not None:
        if "data" in entry:
            raise InvalidInput(f"{where}: has both 'data' and binary_data_size; send one")
        if size < 0 or offset + size > len(binary):
            raise InvalidInput(
                f"{where}: binary_data_size {size} at byte {offset} of the binary data, which has "
                f"{len(binary)} bytes (check {HEADER_LENGTH})"
            )
        return bytes(binary[offset : offset + size]), size
    if "data" in entry:
        return _json_tensor_raw(name, datatype, shape, entry["data"], budget), None
    raise InvalidInput(f"{where}: has neither 'data' nor a binary_data_size parameter")


# --- response encoding ---------------------------------------------------------------------------------


#: An output of more elements than this has the size of its JSON estimated from this many of them.
_SAMPLE = 1024
#: Elements written to JSON at once: the size written so far is checked between them.
_CHUNK = 65536


def check_json_size(response: pb.ModelInferResponse, form: OutputForm, max_json_bytes: int) -> int:
    """About the bytes a response's JSON outputs take, estimated without writing them (a BYTES output's
    strings at least their bytes, numbers from a sample of each output); refused when more than
    `max_json_bytes` (0: no limit)."""
    size = sum(
        _json_size(tensor) for tensor in response_tensors(response).values() if not form.binary(tensor.name)
    )
    if max_json_bytes and size > max_json_bytes:
        raise json_too_large(size, max_json_bytes, estimated=True)
    return size


class JsonTooLarge(InvalidInput):
    """A response whose JSON would be larger than the server writes."""


def json_too_large(size: int, limit: int, *, estimated: bool) -> JsonTooLarge:
    """The refusal of a response whose JSON would be `size` bytes (as estimated, or written so far): the
    client is told to ask for binary data."""
    return JsonTooLarge(
        f"the response's JSON would be {'about' if estimated else 'more than'} {_mb(size)}, more than this "
        f"server writes ({_mb(limit)}, --max-json-output-mb): ask for the outputs as binary data (request "
        'parameter "binary_data_output": true, or "binary_data": true in the parameters of each output)'
    )


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


def _json_size(tensor: Tensor) -> int:
    """About the bytes of an output's JSON `data`, estimated without writing it."""
    count = element_count(tensor.shape)
    if tensor.datatype == "BYTES":
        # Each element: at least its bytes, in quotes, after a comma (and no 4-byte length prefix).
        return len(tensor.raw) - count
    if count <= _SAMPLE:
        return 2 * count  # at least a digit and a comma each
    flat = tensor.to_array().reshape(-1)
    sample = flat[:: count // _SAMPLE][:_SAMPLE]
    return count * (len(json.dumps(sample.tolist(), separators=(",", ":"))) - 1) // sample.size


def _json_data(tensor: Tensor) -> Iterator[str]:
    """An output's elements as the JSON text inside its `data` list, a chunk at a time."""
    flat = tensor.to_array().reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        part = flat[start : start + _CHUNK]
        if tensor.datatype != "BYTES":
            values = part.tolist()
        else:
            try:
                values = [bytes(e).decode("utf-8") for e in part]
            except UnicodeDecodeError:
                raise InvalidInput(
                    f"output '{echo(tensor.name)}' holds bytes that are not UTF-8 text: ask for it with "
                    "binary_data"
                ) from None
        yield json.dumps(values, separators=(",", ":"))[1:-1]


def infer_response_body(
    response: pb.ModelInferResponse, form: OutputForm, max_json_bytes: int = 0
) -> tuple[bytes, int | None]:
    """A `ModelInferResponse` as a REST body: the JSON, then the binary outputs' bytes. Returns the body
    and the length of its JSON part when binary data follows (None: all JSON). JSON outputs of more than
    `max_json_bytes` (0: no limit) are refused, as estimated first and as written."""
    check_json_size(response, form, max_json_bytes)
    limit = max_json_bytes or sys.maxsize
    head: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        head["id"] = response.id
    parts = [json.dumps(head, separators=(",", ":"))[:-1], ',"outputs":[']
    written = 0
    binary: list[bytes] = []
    for index, tensor in enumerate(response_tensors(response).values()):
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if index:
            parts.append(",")
        if form.binary(tensor.name):
            out["parameters"] = {"binary_data_size": len(tensor.raw)}
            binary.append(tensor.raw)
            parts.append(json.dumps(out, separators=(",", ":")))
            continue
        parts += [json.dumps(out, separators=(",", ":"))[:-1], ',"data":[']
        for number, chunk in enumerate(_json_data(tensor)):
            written += len(chunk) + 1
            if written > limit:
                raise json_too_large(written, limit, estimated=False)
            parts += [",", chunk] if number else [chunk]
        parts.append("]}")
    parts.append("]}")
    # NOTE: json.dumps writes ASCII only (non-ASCII characters escaped), so characters are bytes.
    header = "".join(parts).encode("ascii")
    if not binary:
        return header, None
    return b"".join([header, *binary]), len(header)


def metadata_json(reply: pb.ModelMetadataResponse) -> dict[str, Any]:
    def tensors(items: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]

    return {
        "name": reply.name,
        "versions": list(reply.versions),
        "platform": reply.platform,
        "inputs": tensors(reply.inputs),
        "outputs": tensors(reply.outputs),
    }


# --- Triton's generate extension -----------------------------------------------------------------------


def generate_request(
    body: bytes, model: str, version: str, inputs: Mapping[str, tuple[str, list[int]]], limit: int
) -> pb.ModelInferRequest:
    """A generate request (Triton's generate extension: one JSON object) as a `ModelInferRequest`. Each
    key that names an input of the model (`inputs`: name -> datatype and metadata shape) becomes that
    tensor, from a value or a flat list: the shape's fixed dimensions are kept, its innermost -1 takes the
    rest of the elements and every other -1 is 1, as Triton shapes them. `parameters` and every other key
    become request parameters; `id` is the request's id. The inputs hold at most `limit` bytes."""
    doc = json_object(body, "request body")
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    budget = limit
    for key, value in doc.items():
        if key in inputs:
            datatype, shape = inputs[key]
            data = value if isinstance(value, list) else [value]
            dims = _generate_shape(key, shape, len(data))
            request.inputs.add(name=key, datatype=datatype, shape=dims)
            raw = _json_tensor_raw(key, datatype, dims, data, budget)
            budget -= len(raw)
            request.raw_input_contents.append(raw)
        elif key == "id" and isinstance(value, str):
            request.id = value
        elif key == "parameters":
            _copy_parameters(request.parameters, json_field(doc, key, dict, "request", {}), "request")
        else:
            request.parameters[key].CopyFrom(_parameter(key, value, "request"))
    return request


def _generate_shape(name: str, shape: list[int], count: int) -> list[int]:
    dims = list(shape)
    rest = count
    for dim in dims:
        if dim != -1:
            if dim == 0 or rest % dim:
                raise InvalidInput(f"the schema can not convert input '{name}' to a tensor of shape {shape}")
            rest //= dim
    for index in range(len(dims) - 1, -1, -1):
        if dims[index] == -1:
            dims[index], rest = rest, 1
    if rest != 1:
        raise InvalidInput(f"the schema can not convert input '{name}' to a tensor of shape {shape}")
    return dims


def generate_response(response: pb.ModelInferResponse) -> dict[str, Any]:
    """A response as the generate extension writes it: `id`, `model_name`, `model_version`, the response's
    parameters, and each output by name (one element as a value, more as a flat list; BYTES as text)."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    for key, param in response.parameters.items():
        choice = param.WhichOneof("parameter_choice")
        if choice is not None and choice != "bytes_param":
            doc[key] = getattr(param, choice)
    for tensor in response_tensors(response).values():
        data = _json_values(tensor)
        doc[tensor.name] = data[0] if len(data) == 1 else data
    return doc


def _json_values(tensor: Tensor) -> list[Any]:
    """An output's elements, flat, as JSON values (BYTES as UTF-8 text)."""
    flat = tensor.to_array().reshape(-1)
    if tensor.datatype != "BYTES":
        return flat.tolist()
    try:
        return [bytes(e).decode("utf-8") for e in flat]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output '{echo(tensor.name)}' holds bytes that are not UTF-8 text, which the generate "
            "extension cannot carry"
        ) from None
