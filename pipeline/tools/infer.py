"""`pipeline infer`: send one request to a model or ensemble and print its outputs, or with `--stream` every
response as it arrives over `ModelStreamInfer` (a decoupled model's many: the text of a generating ensemble
appears as it is written)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated

import grpc
import numpy as np
from pydantic import BaseModel

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.sequences import SequenceId
from pipeline.runtime.client_settings import Client
from pipeline.runtime.settings_cli import ProcessSettings, option, process_settings
from pipeline.tools.client import InferenceClient, StreamError, StreamResponse, bytes_batch, value_array


class InputError(ValueError):
    """The inputs asked for on the command line cannot be made for this model."""


class InferTarget(BaseModel):
    """What `pipeline infer` calls, and the files it sends."""

    files: Annotated[
        list[str],
        option("files", nargs="*", help="files sent as the model's BYTES input, one batch item each"),
    ] = []
    model: Annotated[str, option("--model", "-m", help="ensemble or model name, e.g. digits")]


class InferRequest(BaseModel):
    """The request `pipeline infer` sends, and how it prints the answer."""

    input: Annotated[
        list[str], option("--input", "-i", action="append", metavar="NAME=FILE.npy", help="a numeric input")
    ] = []
    value: Annotated[
        list[str],
        option(
            "--value",
            action="append",
            metavar="NAME=VALUE",
            help="an input of one element, of the datatype the model declares: a number, or text for BYTES "
            "(e.g. --value PROMPT='To be' --value MAX_TOKENS=80)",
        ),
    ] = []
    stream: Annotated[
        bool,
        option(
            "--stream",
            action="store_true",
            help="send the request over ModelStreamInfer and print each response as it arrives (BYTES outputs "
            "as text, one after the other), up to the one flagged final",
        ),
    ] = False
    timeout: Annotated[
        float, option("--timeout", parse=float, help="deadline in seconds (of the whole stream)")
    ] = 30.0
    as_json: Annotated[
        bool, option("--json", action="store_true", help="print the outputs as JSON (a line per response)")
    ] = False
    sequence_id: Annotated[
        str | None,
        option(
            "--sequence-id",
            metavar="ID",
            help="send the request as one of a sequence, for a stateful model (sequence_batching): an unsigned "
            "integer, or any other text as a string id",
        ),
    ] = None
    start: Annotated[
        bool,
        option("--start", action="store_true", help="the request starts its sequence (with --sequence-id)"),
    ] = False
    end: Annotated[
        bool, option("--end", action="store_true", help="the request ends its sequence (with --sequence-id)")
    ] = False


#: `pipeline infer`'s settings: the model and files, the server (`client_settings.Client`), the request.
InferSettings = process_settings("InferSettings", (InferTarget, Client, InferRequest))


def run_infer_command(settings: ProcessSettings) -> int:
    """`pipeline infer`: 0 when answered, 1 when the server refused, 2 when the inputs cannot be made."""
    target, server, request = (
        settings.group(InferTarget),
        settings.group(Client),
        settings.group(InferRequest),
    )
    client = InferenceClient(
        server.url, tls_ca=server.tls_ca, tls_cert=server.tls_cert, tls_key=server.tls_key, token=server.token
    )
    model, timeout = target.model, request.timeout
    with client:
        try:
            sequence = sequence_of_arguments(request)
            inputs = build_inputs(client.model_metadata(model, timeout=timeout), request, target.files)
            if request.stream:
                responses = client.stream(model, inputs, timeout=timeout, sequence=sequence)
                return _print_stream(responses, request.as_json)
            outputs = client.infer(model, inputs, timeout=timeout, sequence=sequence)
        except InputError as err:
            print(err, file=sys.stderr)
            return 2
        except grpc.RpcError as err:
            print(f"{err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    _print_outputs(outputs, target.files, request.as_json)
    return 0


def sequence_of_arguments(request: InferRequest) -> SequenceId | None:
    """The sequence `--sequence-id`, `--start` and `--end` name (None without `--sequence-id`)."""
    if request.sequence_id is None:
        if request.start or request.end:
            raise InputError("--start and --end need --sequence-id")
        return None
    text = request.sequence_id
    value: int | str = int(text) if text.isascii() and text.isdigit() else text
    if not value:
        raise InputError("--sequence-id must not be 0 or empty: that names no sequence")
    return SequenceId(value, request.start, request.end)


def build_inputs(
    meta: pb.ModelMetadataResponse, request: InferRequest, files: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """The request's inputs from `--input` (.npy files), `--value` and the `files` (the model's one BYTES
    input); `InputError` for what does not fit the model's metadata."""
    inputs = {}
    for item in request.input:
        name, _, path = item.partition("=")
        inputs[name] = np.load(path, allow_pickle=False)
    declared = {tensor.name: tensor for tensor in meta.inputs}
    for item in request.value:
        name, sep, text = item.partition("=")
        if not sep or name not in declared:
            raise InputError(
                f"--value expects NAME=VALUE with NAME an input of '{meta.name}' "
                f"({', '.join(declared) or 'none'}), got {item!r}"
            )
        inputs[name] = one_element(declared[name], text)
    if files:
        byte_inputs = [t for t in meta.inputs if t.datatype == "BYTES"]
        if len(byte_inputs) != 1:
            raise InputError(
                f"model '{meta.name}' has no single BYTES input to send files to; use --input NAME=file.npy"
            )
        target = byte_inputs[0]
        inputs[target.name] = bytes_batch([Path(f).read_bytes() for f in files], target.shape)
    return inputs


def one_element(tensor: pb.ModelMetadataResponse.TensorMetadata, text: str) -> np.ndarray:
    """`text` as a one-element input shaped as `tensor` declares (every dimension 1)."""
    try:
        return value_array(tensor.datatype, text, (1,) * max(len(tensor.shape), 1))
    except ValueError as err:
        raise InputError(f"--value {tensor.name}: {err}") from None


def _print_stream(responses: Iterable[StreamResponse], as_json: bool) -> int:
    """Print each response as it arrives: as JSON lines, or BYTES outputs as text run together (other
    outputs as `NAME=value` lines)."""
    count = 0
    try:
        for response in responses:
            count += 1
            if as_json:
                print(json.dumps({"final": response.final, **_jsonable(response.outputs)}), flush=True)
                continue
            for name, array in response.outputs.items():
                if array.dtype == np.object_:
                    text = b"".join(bytes(v) for v in array.reshape(-1))
                    sys.stdout.write(text.decode("utf-8", errors="replace"))
                else:
                    sys.stdout.write(f"{name}={_format(array.reshape(-1))}\n")
            sys.stdout.flush()
    except StreamError as err:
        print(f"\n{err}" if count and not as_json else str(err), file=sys.stderr)
        return 1
    except grpc.RpcError as err:
        print(f"\n{err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if not as_json:
        print(flush=True)
    return 0


def _print_outputs(outputs: Mapping[str, np.ndarray], files: Sequence[str], as_json: bool) -> None:
    """A line per item (per file), or one line with every output whole where the outputs are not one row
    per file (a model that does not batch: a page's digits); BYTES elements as text."""
    if as_json:
        print(json.dumps(_jsonable(outputs)))
        return
    count = next(iter(outputs.values())).shape[0] if outputs else 0
    if files and any(array.shape[:1] != (len(files),) for array in outputs.values()):
        fields = [f"{name}={_format(array.reshape(-1))}" for name, array in outputs.items()]
        print(f"{', '.join(files)}: {'  '.join(fields)}")
        return
    names = list(files) or [f"item {i}" for i in range(count)]
    for i, label in enumerate(names[:count]):
        fields = []
        for name, array in outputs.items():
            row = array[i].reshape(-1)
            fields.append(f"{name}={_format(row)}")
        print(f"{label}: {'  '.join(fields)}")


def _format(row: np.ndarray) -> str:
    if row.dtype == np.object_:
        texts = [bytes(v).decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in row]
        return texts[0] if len(texts) == 1 else repr(texts)
    if row.size == 1:
        return str(row[0])
    return np.array2string(row, precision=3, suppress_small=True, separator=" ", max_line_width=10**6)


def _jsonable(outputs: Mapping[str, np.ndarray]) -> dict[str, list]:
    """Outputs as JSON lists, BYTES elements as text."""
    out = {}
    for name, array in outputs.items():
        if array.dtype == np.object_:
            array = np.vectorize(lambda v: bytes(v).decode("utf-8", errors="replace"), otypes=[object])(array)
        out[name] = array.tolist()
    return out
