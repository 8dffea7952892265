"""Triton's system shared-memory extension: tensors in a POSIX shared-memory region instead of the message.

A client creates a region (a file of `/dev/shm`), registers it with `SystemSharedMemoryRegister` (a name,
its key, an offset and a size), and then names it in a request's tensor parameters: an input's
`shared_memory_region`, `shared_memory_byte_size` and `shared_memory_offset` say where its bytes are, a
requested output's where the server writes them: the tensor then never travels in a message. Triton's
clients and perf_analyzer (`--shared-memory system`) use it with any server on their machine.

`SharedMemoryRegistry` is the server side. It attaches only regions whose file belongs to the server's own
user, so a client cannot make it read or write another user's memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline.protocol.errors import InvalidInput, ModelNotFound

#: Tensor parameters of the extension.
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"
#: `ServerMetadata.extensions`: the extension's name, as Triton lists it.
EXTENSION = "system_shared_memory"
#: Where POSIX shared-memory objects live (shm_open's names).
SHM_DIR = "/dev/shm"


def shm_path(key: str) -> str:
    """The file of a POSIX shared-memory key (`/name` or `name`)."""
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", ".."):
        raise InvalidInput(f"shared memory key {key!r} is not a POSIX shared-memory name (/name)")
    return os.path.join(SHM_DIR, name)


@dataclass(eq=False)
class Region:
    """A registered region: `byte_size` bytes of a mapped file, from `offset`."""

    name: str
    key: str
    offset: int
    byte_size: int
    memory: mmap.mmap

    def view(self, offset: int, size: int, what: str) -> memoryview:
        """`size` bytes at `offset` within the region; `InvalidInput` where they fall outside it."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise InvalidInput(
                f"{what}: {size} bytes at offset {offset} do not fit shared memory region '{self.name}' "
                f"({self.byte_size} bytes)"
            )
        start = self.offset + offset
        return memoryview(self.memory)[start : start + size]


def attach(key: str, offset: int, byte_size: int) -> mmap.mmap:
    """Map the region's file (read and write); `InvalidInput` naming what is wrong with it."""
    path = shm_path(key)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as err:
        raise InvalidInput(f"cannot open shared memory key {key!r}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise InvalidInput(f"shared memory key {key!r} is not a region of this server's user")
        if byte_size <= 0 or offset < 0 or offset + byte_size > info.st_size:
            raise InvalidInput(
                f"shared memory key {key!r}: {byte_size} bytes at offset {offset} do not fit its "
                f"{info.st_size} bytes"
            )
        return mmap.mmap(fd, info.st_size)
    finally:
        os.close(fd)


class SharedMemoryRegistry:
    """The regions registered with one server, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidInput("a shared memory region needs a name")
        with self._lock:
            if name in self._regions:
                raise InvalidInput(f"shared memory region '{name}' is already registered")
            self._regions[name] = Region(name, key, offset, byte_size, attach(key, offset, byte_size))

    def unregister(self, name: str) -> None:
        """Forget one region, or every region for an empty name; an unknown name is not an error (Triton)."""
        with self._lock:
            names = [name] if name else list(self._regions)
            regions = [self._regions.pop(n) for n in names if n in self._regions]
        for region in regions:
            # A view of it still in use keeps it mapped until that goes.
            with contextlib.suppress(BufferError):
                region.memory.close()

    def status(self, name: str) -> pb.SystemSharedMemoryStatusResponse:
        with self._lock:
            if name and name not in self._regions:
                raise ModelNotFound(f"unknown shared memory region '{name}'")
            regions = [self._regions[name]] if name else list(self._regions.values())
        reply = pb.SystemSharedMemoryStatusResponse()
        for region in regions:
            entry = reply.regions[region.name]
            entry.name, entry.key = region.name, region.key
            entry.offset, entry.byte_size = region.offset, region.byte_size
        return reply

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._regions))

    def _region(self, name: str, what: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"{what}: unknown shared memory region '{name}'")
        return region

    def resolve_inputs(self, request: pb.ModelInferRequest) -> None:
        """Give every input that lives in a region its bytes in `raw_input_contents`, so the server goes on
        as for any request. Requests without shared memory pass untouched."""
        placed = [_placement(t.parameters) for t in request.inputs]
        if not any(placed):
            return
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise InvalidInput(
                "inputs in shared memory: give raw_input_contents for every other input (an empty entry "
                "for those in shared memory) or for none"
            )
        contents: list[bytes] = []
        for i, (tensor, where) in enumerate(zip(request.inputs, placed, strict=True)):
            if where is None:
                if not raw:
                    raise InvalidInput(
                        f"input '{tensor.name}': not in shared memory, so its data must be in "
                        "raw_input_contents"
                    )
                contents.append(raw[i])
                continue
            name, size, offset = where
            what = f"input '{tensor.name}'"
            contents.append(bytes(self._region(name, what).view(offset, size, what)))
            _forget(tensor.parameters)
        del request.raw_input_contents[:]
        request.raw_input_contents.extend(contents)

    def requested_outputs(self, request: pb.ModelInferRequest) -> dict[str, tuple[str, int, int]]:
        """The outputs a request asks to be written into regions: name -> (region, byte size, offset)."""
        found = {}
        for output in request.outputs:
            where = _placement(output.parameters)
            if where is not None:
                self._region(where[0], f"output '{output.name}'")  # known now, not after the work
                found[output.name] = where
                _forget(output.parameters)  # the server's own business, not its model's
        return found

    def write_outputs(self, response: pb.ModelInferResponse, placed: dict[str, tuple[str, int, int]]) -> None:
        """Move the outputs `placed` names from the response into their regions: each keeps its name,
        datatype and shape, gets the region in its parameters and an empty `raw_output_contents` entry."""
        raw = response.raw_output_contents
        for i, output in enumerate(response.outputs):
            where = placed.get(output.name)
            if where is None:
                continue
            name, size, offset = where
            data = raw[i]
            what = f"output '{output.name}'"
            if len(data) > size:
                raise InvalidInput(
                    f"{what} needs {len(data)} bytes; shared memory region '{name}' was given "
                    f"shared_memory_byte_size {size}"
                )
            self._region(name, what).view(offset, len(data), what)[:] = data
            output.parameters[REGION].string_param = name
            output.parameters[BYTE_SIZE].int64_param = len(data)
            if offset:
                output.parameters[OFFSET].int64_param = offset
            raw[i] = b""


def _placement(parameters) -> tuple[str, int, int] | None:
    """(region, byte size, offset) a tensor's parameters give, or None."""
    if REGION not in parameters:
        return None
    region = parameters[REGION].string_param
    size = parameters[BYTE_SIZE].int64_param if BYTE_SIZE in parameters else -1
    if not region or size < 0:
        raise InvalidInput(f"'{REGION}' needs a region name and '{BYTE_SIZE}'")
    offset = parameters[OFFSET].int64_param if OFFSET in parameters else 0
    return region, size, offset


def _forget(parameters) -> None:
    for key in (REGION, BYTE_SIZE, OFFSET):
        if key in parameters:
            del parameters[key]
