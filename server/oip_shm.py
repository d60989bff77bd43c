"""Shared-memory regions for the Open Inference Protocol: the system and CUDA
shared-memory extensions as Triton defines them (register / status / unregister
RPCs, and the tensor parameters shared_memory_region, shared_memory_offset,
shared_memory_byte_size in ModelInfer).

System regions are byte ranges of a POSIX shared-memory object that the client
created (its shm_open key, e.g. "/inputs"). The server opens the object once, at
registration, checks the range against the object's size, and from then on reads
inputs with pread and writes outputs with pwrite on that descriptor. It does not
map the object: if the client shrank its object under a mapping, the server's
next access would fault (SIGBUS) and stop it for every client; pread and pwrite
see a short object instead, which fails that one request. Reading costs one copy
of each input, which also means a client cannot change the routing ids between
their validation and the compute.

CUDA regions are device allocations the client exported with
cudaIpcGetMemHandle; the server opens the handle once, at registration
(cudaIpcOpenMemHandle), copies inputs out of it and outputs into it with
cudaMemcpy, and closes it when the region is unregistered.

A region that a request is using stays open until that request ends, even when
it is unregistered meanwhile (Triton does the same); unregistering and server
shutdown close it. Everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import stat
from dataclasses import dataclass

import grpc
import numpy as np

from expertd.server.validate import RequestError, invalid

SYSTEM, CUDA = "system", "CUDA"
SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps POSIX shared-memory objects
MAX_REGIONS = 256  # registered regions at once (system and CUDA); each holds a descriptor
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
INLINE_BYTES = 1 << 20  # copies up to this size run on the event loop, larger ones off it
PARAMS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
DISABLED = (
    "client shared memory is off on this server: start it with --allow-client-shm "
    "(or EXPERTD_ALLOW_CLIENT_SHM=1) to register regions"
)


def _not_found(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.NOT_FOUND, message)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor lives: a registered region and a byte range in it."""

    region: str
    offset: int
    byte_size: int


def tensor_ref(tensor) -> TensorRef | None:
    """A ModelInfer input's or requested output's shared-memory parameters, or None."""
    params = tensor.parameters
    if PARAMS[0] not in params:
        for key in PARAMS[1:]:
            if key in params:
                raise invalid(f"{tensor.name}: '{key}' given without 'shared_memory_region'")
        return None
    region = params[PARAMS[0]]
    if region.WhichOneof("parameter_choice") != "string_param":
        raise invalid(f"{tensor.name}: 'shared_memory_region' must be a string parameter")
    if PARAMS[2] not in params:
        raise invalid(f"{tensor.name}: 'shared_memory_region' needs 'shared_memory_byte_size'")
    values = []
    for key in PARAMS[1:]:
        param = params.get(key)
        if param is None:  # the offset is optional
            values.append(0)
            continue
        kind = param.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise invalid(f"{tensor.name}: '{key}' must be an integer parameter")
        value = getattr(param, kind)
        if value < 0:
            raise invalid(f"{tensor.name}: '{key}' is {value}, must not be negative")
        values.append(value)
    return TensorRef(region.string_param, values[0], values[1])


class Region:
    kind = ""

    def __init__(self, name: str, byte_size: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.users = 0  # requests using it now
        self.unregistered = False

    def read_into(self, offset: int, buf: np.ndarray) -> None:
        """Fill `buf` (uint8) from [offset, offset + len(buf)) of the region."""
        raise NotImplementedError

    def write(self, offset: int, data: memoryview) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SystemRegion(Region):
    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset  # of the region in the shared-memory object
        self.fd = fd

    def _shrunk(self) -> RequestError:
        return invalid(
            f"shared-memory region '{self.name}': object '{self.key}' no longer holds the "
            "registered range (it was truncated after registration)"
        )

    def read_into(self, offset: int, buf: np.ndarray) -> None:
        try:
            done = os.preadv(self.fd, [buf], self.offset + offset) if len(buf) else 0
        except OSError as e:
            raise invalid(f"shared-memory region '{self.name}': {os.strerror(e.errno)}") from None
        if done != len(buf):
            raise self._shrunk()

    def write(self, offset: int, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        start = self.offset + offset
        try:
            if os.fstat(self.fd).st_size < start + len(view):  # never grow what was shrunk
                raise self._shrunk()
            done = 0
            while done < len(view):  # pwrite may write less than asked
                done += os.pwrite(self.fd, view[done:], start + done)
        except OSError as e:
            raise invalid(f"shared-memory region '{self.name}': {os.strerror(e.errno)}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CudaRegion(Region):
    kind = CUDA

    def __init__(self, name: str, device_id: int, byte_size: int, ptr: int, rt) -> None:
        super().__init__(name, byte_size)
        self.device_id = device_id
        self.ptr = ptr  # the device address cudaIpcOpenMemHandle gave
        self._rt = rt

    def _copy(self, dst: int, src: int, size: int, kind) -> None:
        with _on_device(self._rt, self.device_id):
            result = self._rt.cudaMemcpy(dst, src, size, kind)
        _check(self._rt, result, f"copying through CUDA shared-memory region '{self.name}'")

    def read_into(self, offset: int, buf: np.ndarray) -> None:
        if len(buf):
            kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._copy(buf.ctypes.data, self.ptr + offset, len(buf), kind)

    def write(self, offset: int, data: memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if len(src):
            kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._copy(self.ptr + offset, src.ctypes.data, len(src), kind)

    def close(self) -> None:
        if self.ptr:
            with _on_device(self._rt, self.device_id):
                self._rt.cudaIpcCloseMemHandle(self.ptr)
            self.ptr = 0


class SharedMemoryRegistry:
    """The registered regions of one server, by name (system and CUDA share names)."""

    def __init__(self, allowed: bool) -> None:
        self.allowed = allowed
        self.regions: dict[str, Region] = {}

    def _check_new(self, kind: str, name: str) -> None:
        if not self.allowed:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED, DISABLED)
        if not name:
            raise invalid(f"a {kind} shared-memory region needs a name")
        if name in self.regions:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"shared-memory region '{name}' is already registered (unregister it first)",
            )
        if len(self.regions) >= MAX_REGIONS:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.regions)} shared-memory regions are registered, the most this "
                f"server holds; unregister some first",
            )

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_new(SYSTEM, name)
        path = os.path.join(SHM_DIR, _object_name(name, key))
        if byte_size == 0:
            raise invalid(f"cannot register shared-memory region '{name}': byte_size is 0")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise _not_found(
                f"cannot register shared-memory region '{name}': no shared-memory object "
                f"'{key}' on the server's host (client and server must share {SHM_DIR})"
            ) from None
        except PermissionError:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"cannot register shared-memory region '{name}': the server may not open "
                f"shared-memory object '{key}' for reading and writing",
            ) from None
        except OSError as e:
            raise invalid(
                f"cannot register shared-memory region '{name}': cannot open shared-memory "
                f"object '{key}' ({os.strerror(e.errno or errno.EINVAL)})"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise invalid(
                    f"cannot register shared-memory region '{name}': '{key}' is not a "
                    "shared-memory object"
                )
            if offset + byte_size > info.st_size:
                raise invalid(
                    f"cannot register shared-memory region '{name}': offset {offset} + "
                    f"byte_size {byte_size} is past the end of shared-memory object '{key}' "
                    f"({info.st_size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        self.regions[name] = SystemRegion(name, key, offset, byte_size, fd)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._check_new(CUDA, name)
        rt, drv = _cuda(name)
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise invalid(
                f"cannot register CUDA shared-memory region '{name}': raw_handle has "
                f"{len(raw_handle)} bytes, a cudaIpcMemHandle_t has {IPC_HANDLE_BYTES}"
            )
        err, count = rt.cudaGetDeviceCount()
        count = count if err == rt.cudaError_t.cudaSuccess else 0
        if not 0 <= device_id < count:
            raise invalid(
                f"cannot register CUDA shared-memory region '{name}': no CUDA device "
                f"{device_id} on this server ({count} devices)"
            )
        if byte_size == 0:
            raise invalid(f"cannot register CUDA shared-memory region '{name}': byte_size is 0")
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, IPC_HANDLE_BYTES)
        with _on_device(rt, device_id):
            err, ptr = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
            if err != rt.cudaError_t.cudaSuccess:
                raise invalid(
                    f"cannot register CUDA shared-memory region '{name}': cannot open its "
                    f"IPC handle on device {device_id} ({_error_name(rt, err)})"
                )
            result, base, size = drv.cuMemGetAddressRange(ptr)
        region = CudaRegion(name, device_id, byte_size, int(ptr), rt)
        if result != drv.CUresult.CUDA_SUCCESS or int(ptr) + byte_size > int(base) + int(size):
            region.close()
            raise invalid(
                f"cannot register CUDA shared-memory region '{name}': byte_size {byte_size} "
                f"is larger than the exported allocation ({int(size)} bytes)"
            )
        self.regions[name] = region

    def status(self, kind: str, name: str) -> list[Region]:
        if not name:
            return [r for r in self.regions.values() if r.kind == kind]
        region = self.regions.get(name)
        if region is None:
            raise _not_found(f"no {kind} shared-memory region '{name}' is registered")
        if region.kind != kind:
            raise _not_found(
                f"shared-memory region '{name}' is registered as {region.kind} shared memory, "
                f"not {kind}"
            )
        return [region]

    def unregister(self, kind: str, name: str) -> None:
        """Unregister `name` (empty: every region of `kind`); unknown names are no error,
        as in Triton, so that cleaning up twice is harmless."""
        if not self.allowed:
            raise RequestError(grpc.StatusCode.UNIMPLEMENTED, DISABLED)
        names = [n for n, r in self.regions.items() if r.kind == kind and (not name or n == name)]
        for n in names:
            region = self.regions.pop(n)
            region.unregistered = True
            if region.users == 0:
                region.close()

    def close(self) -> None:
        """Server shutdown: close every region."""
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def lease(self, max_read_bytes: int) -> RequestLease:
        return RequestLease(self, max_read_bytes)


class RequestLease:
    """The regions one ModelInfer request uses: each stays open (even if unregistered
    meanwhile) until release(), which the request calls when it ends."""

    def __init__(self, registry: SharedMemoryRegistry, max_read_bytes: int) -> None:
        self.registry = registry
        self.max_read_bytes = max_read_bytes  # no accepted request has a larger input
        self.regions: list[Region] = []
        self.pending: list[tuple[Region, int, np.ndarray]] = []  # copies fill() will make

    def region(self, what: str, ref: TensorRef) -> Region:
        """The region `ref` names, checked to hold [offset, offset + byte_size)."""
        region = self.registry.regions.get(ref.region)
        if region is None:
            raise _not_found(f"{what}: no shared-memory region '{ref.region}' is registered")
        if ref.offset >= region.byte_size:
            raise invalid(
                f"{what}: shared_memory_offset {ref.offset} is outside region "
                f"'{region.name}' ({region.byte_size} bytes)"
            )
        if ref.offset + ref.byte_size > region.byte_size:
            raise invalid(
                f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} is past the end of region '{region.name}' "
                f"({region.byte_size} bytes)"
            )
        region.users += 1
        self.regions.append(region)
        return region

    def read(self, what: str, ref: TensorRef) -> memoryview:
        """A copy of an input's bytes: copied now when small, else by fill() (which the
        request runs off the event loop before using them)."""
        if ref.byte_size > self.max_read_bytes:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{what}: shared_memory_byte_size {ref.byte_size} is larger than any request "
                f"this server accepts ({self.max_read_bytes} bytes)",
            )
        region = self.region(what, ref)
        buf = np.empty(ref.byte_size, dtype=np.uint8)
        if ref.byte_size <= INLINE_BYTES:
            region.read_into(ref.offset, buf)
        else:
            self.pending.append((region, ref.offset, buf))
        return memoryview(buf)

    def fill(self) -> None:
        """Copy the inputs read() left for later (on any thread: their regions stay open
        while this request holds them)."""
        for region, offset, buf in self.pending:
            region.read_into(offset, buf)
        self.pending.clear()

    def release_after(self, copying: asyncio.Future | None) -> None:
        """release() once `copying`, an off-loop copy through these regions, has ended
        (it goes on when the request is cancelled: a region must not close under it)."""

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: the request has already answered or gone
            self.release()

        if copying is None:
            self.release()
        elif copying.done():
            done(copying)
        else:
            copying.add_done_callback(done)

    def release(self) -> None:
        for region in self.regions:
            region.users -= 1
            if region.users == 0 and region.unregistered:
                region.close()
        self.regions.clear()


def _object_name(name: str, key: str) -> str:
    """shm_open's rules for a key: leading slashes, then one path component."""
    base = key.lstrip("/")
    if not base or "/" in base or base in (".", "..") or "\0" in base or len(base) > 255:
        raise invalid(
            f"cannot register shared-memory region '{name}': '{key}' is not a valid "
            "shared-memory key (want '/name', as shm_open takes)"
        )
    return base


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda(name: str):
    if not cuda_available():
        raise invalid(
            f"cannot register CUDA shared-memory region '{name}': this server has no CUDA device"
        )
    try:
        import cuda.bindings.driver as drv
        import cuda.bindings.runtime as rt
    except ImportError:
        raise RequestError(
            grpc.StatusCode.UNIMPLEMENTED,
            "CUDA shared memory needs the cuda-bindings package on the server",
        ) from None
    return rt, drv


def _error_name(rt, err) -> str:
    found, name = rt.cudaGetErrorName(err)
    return name.decode() if found == rt.cudaError_t.cudaSuccess else str(err)


def _check(rt, result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        raise invalid(f"{what} failed ({_error_name(rt, err)})")


class _on_device:
    """Make `device_id` current on this thread for a block, then restore the previous one
    (the event loop's thread also launches the server's own small batches)."""

    def __init__(self, rt, device_id: int) -> None:
        self.rt, self.device_id, self.previous = rt, device_id, None

    def __enter__(self) -> None:
        err, current = self.rt.cudaGetDevice()
        if err == self.rt.cudaError_t.cudaSuccess and current != self.device_id:
            self.previous = current
            self.rt.cudaSetDevice(self.device_id)

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            self.rt.cudaSetDevice(self.previous)
