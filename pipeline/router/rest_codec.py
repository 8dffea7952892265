"""The JSON codec of the Open Inference Protocol's REST API: request bodies to protobuf, and back.

An inference request's body becomes a `pb.ModelInferRequest` (every input as raw contents) and the form
each output is wanted in; a `pb.ModelInferResponse` becomes a body. Nothing here knows about HTTP
servers: `pipeline.router.http` serves what this decodes.

Binary tensor data (Triton's extension, what `tritonclient.http` sends by default): the body is a JSON
header of `Inference-Header-Content-Length` bytes followed by each input's raw bytes (`binary_data_size` in
its parameters), in order; outputs asked for with `binary_data: true` (or every output, with the request
parameter `binary_data_output: true`) come back the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.codec import Tensor, response_tensors
from pipeline.protocol.datatypes import DATATYPES, element_count
from pipeline.protocol.errors import InvalidInput

#: The header that says how many bytes of the body are the JSON part (Triton's binary data extension).
HEADER_LENGTH = "Inference-Header-Content-Length"


# --- request decoding ----------------------------------------------------------------------------------


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
    try:
        length = int(header_length)
    except ValueError:
        raise InvalidInput(f"{HEADER_LENGTH} must be a number of bytes, got '{header_length[:40]}'") from None
    if not 0 <= length <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {length}, but the request body has {len(body)} bytes")
    return body[:length], memoryview(body)[length:]


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


def _json_tensor_raw(name: str, datatype: str, shape: list[int], data: Any) -> bytes:
    """The raw bytes of an input sent as JSON `data` (flat or nested, row-major)."""
    what = f"input '{name}'"
    if not isinstance(data, list):
        raise InvalidInput(f"{what}: 'data' must be a list, got {json.dumps(data)[:60]}")
    count = element_count(shape)
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
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[pb.ModelInferRequest, OutputForm]:
    """A REST inference request as the protocol's `ModelInferRequest` (every input as raw contents), and
    the form each output is wanted in."""
    try:
        return _infer_request(body, header_length, model, version)
    except UnicodeEncodeError as err:  # JSON may escape lone surrogates, which no UTF-8 string can hold
        raise InvalidInput(
            f"the request holds a string that is not valid Unicode: {err.object[err.start : err.end]!r} "
            "(a lone surrogate)"
        ) from None


def _infer_request(
    body: bytes, header_length: str | None, model: str, version: str
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
    for index, entry in enumerate(inputs):
        if not isinstance(entry, dict):
            raise InvalidInput(f"inputs[{index}] must be a JSON object")
        name = json_field(entry, "name", str, f"inputs[{index}]", None)
        if name is None:
            raise InvalidInput(f"inputs[{index}] has no 'name'")
        where = f"input '{name}'"
        datatype = json_field(entry, "datatype", str, where, None)
        if datatype not in DATATYPES:
            raise InvalidInput(
                f"{where}: unknown datatype '{datatype}' (expected one of {', '.join(DATATYPES)})"
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
            request.raw_input_contents.append(bytes(binary[offset : offset + size]))
            offset += size
        elif "data" in entry:
            request.raw_input_contents.append(_json_tensor_raw(name, datatype, shape, entry["data"]))
        else:
            raise InvalidInput(f"{where}: has neither 'data' nor a binary_data_size parameter")
    if offset != len(binary):
        raise InvalidInput(
            f"{len(binary)} bytes of binary data follow the JSON header ({HEADER_LENGTH}), but the "
            f"inputs' binary_data_size add up to {offset}"
        )
    asked: dict[str, bool] = {}
    for index, entry in enumerate(json_field(doc, "outputs", list, what, [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidInput(f"outputs[{index}] must be a JSON object with a 'name'")
        where = f"output '{entry['name']}'"
        params = json_field(entry, "parameters", dict, where, {})
        if "classification" in params:
            raise InvalidInput(f"{where}: the classification extension is not supported here")
        asked[entry["name"]] = json_field(params, "binary_data", bool, f"{where} parameters", default_binary)
        output = request.outputs.add(name=entry["name"])
        _copy_parameters(output.parameters, params, where, frozenset({"binary_data"}))
    return request, OutputForm(default_binary, asked)


# --- response encoding ---------------------------------------------------------------------------------


def _json_data(tensor: Tensor) -> list[Any]:
    flat = tensor.to_array().reshape(-1)
    if tensor.datatype != "BYTES":
        return flat.tolist()
    try:
        return [bytes(e).decode("utf-8") for e in flat]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output '{tensor.name}' holds bytes that are not UTF-8 text: ask for it with binary_data"
        ) from None


def infer_response_body(response: pb.ModelInferResponse, form: OutputForm) -> tuple[bytes, int | None]:
    """A `ModelInferResponse` as a REST body: the JSON, then the binary outputs' bytes. Returns the body
    and the length of its JSON part when binary data follows (None: all JSON)."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        doc["id"] = response.id
    outputs = []
    binary: list[bytes] = []
    for tensor in response_tensors(response).values():
        out: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if form.binary(tensor.name):
            out["parameters"] = {"binary_data_size": len(tensor.raw)}
            binary.append(tensor.raw)
        else:
            out["data"] = _json_data(tensor)
        outputs.append(out)
    doc["outputs"] = outputs
    header = json.dumps(doc, separators=(",", ":")).encode()
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
    body: bytes, model: str, version: str, inputs: Mapping[str, tuple[str, list[int]]]
) -> pb.ModelInferRequest:
    """A generate request (Triton's generate extension: one JSON object) as a `ModelInferRequest`. Each
    key that names an input of the model (`inputs`: name -> datatype and metadata shape) becomes that
    tensor, from a value or a flat list: the shape's fixed dimensions are kept, its innermost -1 takes the
    rest of the elements and every other -1 is 1, as Triton shapes them. `parameters` and every other key
    become request parameters; `id` is the request's id."""
    doc = json_object(body, "request body")
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for key, value in doc.items():
        if key in inputs:
            datatype, shape = inputs[key]
            data = value if isinstance(value, list) else [value]
            dims = _generate_shape(key, shape, len(data))
            request.inputs.add(name=key, datatype=datatype, shape=dims)
            request.raw_input_contents.append(_json_tensor_raw(key, datatype, dims, data))
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
        data = _json_data(tensor)
        doc[tensor.name] = data[0] if len(data) == 1 else data
    return doc
