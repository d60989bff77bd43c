"""Device memory that another process of this host can map (CUDA IPC), for the
`cuda-ipc` slots of the same-host data plane (docs/dataplane.md).

The shard allocates each slot's device regions with cudaMalloc, outside torch's
caching allocator (whose expandable segments cannot be exported), and hands the
client a cudaIpcGetMemHandle for each; the client opens it once with
cudaIpcOpenMemHandle (peer access enabled when the memory lives on another GPU).
Both ends then see the memory as a torch uint8 tensor (through
`__cuda_array_interface__`), so every copy into or out of it is an ordinary torch
copy on an ordinary stream.

The same runtime page-locks host memory that another process shares with this one
(`PinnedHost`: a shm slot's memfd mapping in a GPU shard), so copies between it and
the GPU are DMA straight from the slot, with no bounce through a staging buffer.

The CUDA runtime is the one torch loaded (found in /proc/self/maps), called through
ctypes: nothing beyond torch is needed. Linux only.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the MPS control daemon's default pipe directory


def mps_control_pipe() -> str | None:
    """The control pipe of an MPS control daemon this process's CUDA would connect
    through ($CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps, holding `control`), or
    None. With one, the processes sharing a GPU run their work side by side; without,
    the GPU time-slices between them, which costs a cross-process call on one GPU
    0.1-0.3 ms in context switches (docs/operations.md, "Several processes on one GPU").
    A file check, not a connection (a daemon killed without `quit` may leave its pipe)."""
    directory = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY
    path = os.path.join(directory, "control")
    return path if os.path.exists(path) else None


class on_stream:
    """`with on_stream(s):` makes `s` the current stream of its device (and its device
    the current one) for the block, as `with torch.cuda.stream(s):` does, for the
    per-call paths of the data plane. torch.cuda.stream builds Stream objects and
    checks the device's availability on every entry and exit, tens of microseconds a
    switch under a busy interpreter; this calls the three bindings those wrappers
    end in and nothing else. Single use, any thread."""

    __slots__ = ("_prev", "_prev_device", "_target")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._target = (stream.stream_id, stream.device_index, stream.device_type)

    def __enter__(self) -> None:
        self._prev_device = torch._C._cuda_getDevice()
        self._prev = torch._C._cuda_getCurrentStream(self._target[1])
        torch._C._cuda_setStream(*self._target)  # also makes its device the current one

    def __exit__(self, *exc) -> None:
        torch._C._cuda_setStream(*self._prev)
        if self._prev_device != self._target[1]:
            torch._C._cuda_setDevice(self._prev_device)


class CudaIpcError(RuntimeError):
    """A CUDA IPC step failed (the message names the runtime's error)."""


class _Handle(ctypes.Structure):
    _fields_ = (("reserved", ctypes.c_char * HANDLE_BYTES),)


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def _runtime_paths() -> list[str]:
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.count("/") else ""
                if "libcudart.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return [*found, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]


def runtime() -> ctypes.CDLL:
    """The CUDA runtime library (CudaIpcError when there is none to load)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        if not torch.cuda.is_available():
            raise CudaIpcError("no CUDA device in this process")
        torch.cuda.init()
        errors = []
        for name in _runtime_paths():
            try:
                lib = ctypes.CDLL(name)
            except OSError as e:
                errors.append(str(e))
                continue
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaGetErrorString.argtypes = (ctypes.c_int,)
            lib.cudaSetDevice.argtypes = (ctypes.c_int,)
            lib.cudaMalloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
            lib.cudaFree.argtypes = (ctypes.c_void_p,)
            lib.cudaIpcGetMemHandle.argtypes = (ctypes.POINTER(_Handle), ctypes.c_void_p)
            lib.cudaIpcOpenMemHandle.argtypes = (
                ctypes.POINTER(ctypes.c_void_p),
                _Handle,
                ctypes.c_uint,
            )
            lib.cudaIpcCloseMemHandle.argtypes = (ctypes.c_void_p,)
            lib.cudaHostRegister.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
            lib.cudaHostGetDevicePointer.argtypes = (
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_uint,
            )
            lib.cudaHostUnregister.argtypes = (ctypes.c_void_p,)
            _lib = lib
            return lib
        raise CudaIpcError(f"the CUDA runtime library is not loadable: {'; '.join(errors)}")


def make_current(device: torch.device) -> None:
    """Make `device`'s primary context current on the calling thread, for driver calls
    that take no stream (cuEventCreate, cuEventSynchronize): torch's device guard skips
    the runtime call when the device is already the thread's, which leaves a new thread
    without a current context."""
    lib = runtime()
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check(lib.cudaSetDevice(index), "cudaSetDevice")
    _check(lib.cudaFree(None), "cudaFree")  # the context is made and current from here


def available() -> tuple[bool, str]:
    """(whether this process can export and map CUDA IPC memory, why not)."""
    try:
        runtime()
    except CudaIpcError as e:
        return False, str(e)
    return True, ""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        # taken off the runtime's last error too: a failed call here must not be reported
        # again by the next kernel launch anywhere in the process (torch checks it there)
        runtime().cudaGetLastError()
        text = runtime().cudaGetErrorString(rc).decode(errors="replace")
        raise CudaIpcError(f"{what}: {text} (CUDA error {rc})")


class _Span:
    """A device range as `__cuda_array_interface__` (torch.as_tensor shares it and keeps
    this object, hence its owner, alive as long as any tensor views it)."""

    def __init__(self, ptr: int, nbytes: int, owner) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class DeviceBuffer:
    """`nbytes` of device memory allocated here with cudaMalloc, exportable."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        lib = runtime()
        self.device = torch.device(device)
        self.nbytes = nbytes
        ptr = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib.cudaSetDevice(self.device.index or 0), "cudaSetDevice")
            _check(lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
        self.ptr: int | None = ptr.value
        self._tensor = torch.as_tensor(_Span(self.ptr, nbytes, self))

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 [nbytes] over the memory."""
        return self._tensor

    def handle(self) -> bytes:
        """The IPC handle another process opens with `ImportedBuffer`."""
        h = _Handle()
        with torch.cuda.device(self.device):
            _check(runtime().cudaIpcGetMemHandle(ctypes.byref(h), self.ptr), "cudaIpcGetMemHandle")
        return bytes(h)  # the raw 64 bytes (h.reserved would stop at the first NUL)

    def free(self) -> None:
        """Free the memory: only once no queued GPU work and no tensor uses it."""
        if self.ptr is None:
            return
        self._tensor = None
        ptr, self.ptr = self.ptr, None
        with torch.cuda.device(self.device):
            _check(runtime().cudaFree(ptr), "cudaFree")


class ImportedBuffer:
    """Another process's DeviceBuffer, opened from its handle on `device` (the GPU this
    process works on; peer access is enabled when the memory lives on another)."""

    def __init__(self, handle: bytes, nbytes: int, device: torch.device) -> None:
        if len(handle) != HANDLE_BYTES:
            raise CudaIpcError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        lib = runtime()
        self.device = torch.device(device)
        self.nbytes = nbytes
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            _check(lib.cudaSetDevice(self.device.index or 0), "cudaSetDevice")
            rc = lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _LAZY_PEER_ACCESS)
            _check(rc, "cudaIpcOpenMemHandle")
        self.ptr: int | None = ptr.value
        # torch asks the pointer which device it lives on: the exporter's GPU (naming a
        # device here would copy the memory there instead of viewing it)
        self._tensor = torch.as_tensor(_Span(self.ptr, nbytes, self))

    @property
    def tensor(self) -> torch.Tensor:
        return self._tensor

    def close(self) -> None:
        """Unmap: only once no queued GPU work and no tensor uses it."""
        if self.ptr is None:
            return
        self._tensor = None
        ptr, self.ptr = self.ptr, None
        with torch.cuda.device(self.device):
            _check(runtime().cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped


class PinnedHost:
    """`nbytes` of host memory at `addr` (mapped by the caller, page aligned), page-locked
    and registered with the CUDA driver (cudaHostRegister) for as long as this object
    is not released: torch's non_blocking copies between it and a GPU are then
    asynchronous DMA. Every page is made resident by the registration.

    `mapped`: also mapped into the GPUs' address space; `device_ptr` is then where a
    stream's memory operations (`write_value`, `wait_value`) reach it."""

    def __init__(self, addr: int, nbytes: int, device: torch.device, mapped: bool = False) -> None:
        self.device = torch.device(device)
        self.nbytes = nbytes
        flags = _HOST_REGISTER_MAPPED | _HOST_REGISTER_PORTABLE if mapped else 0
        lib = runtime()
        self.device_ptr = 0
        with torch.cuda.device(self.device):
            _check(
                lib.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), flags),
                "cudaHostRegister",
            )
            if mapped:
                ptr = ctypes.c_void_p()
                rc = lib.cudaHostGetDevicePointer(ctypes.byref(ptr), ctypes.c_void_p(addr), 0)
                if rc != 0:
                    lib.cudaHostUnregister(ctypes.c_void_p(addr))
                    _check(rc, "cudaHostGetDevicePointer")
                self.device_ptr = ptr.value
        self.addr: int | None = addr

    def device_tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] at `offset` of the mapped range, as a CUDA tensor (kernels and
        copies on the GPU read and write the host memory through it); `mapped` only."""
        if not self.device_ptr or offset < 0 or offset + nbytes > self.nbytes:
            raise CudaIpcError(f"no mapped range [{offset}, {offset + nbytes}) here")
        return torch.as_tensor(_Span(self.device_ptr + offset, nbytes, self))

    def release(self) -> None:
        """Unregister: only once no queued copy reads or writes the memory, and before
        it is unmapped."""
        if self.addr is None:
            return
        addr, self.addr = self.addr, None
        with torch.cuda.device(self.device):
            _check(runtime().cudaHostUnregister(ctypes.c_void_p(addr)), "cudaHostUnregister")


# -- stream memory operations (the CUDA driver API) -------------------------------------

# cuStreamWaitValue32 conditions
WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ (cyclic: (int32)(*addr - value) >= 0)
WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ

_driver: ctypes.CDLL | None = None
_driver_fns: dict[str, ctypes._CFuncPtr] = {}


def _driver_fn(lib: ctypes.CDLL, *names: str):
    for name in names:  # the _v2 entry points are what cuda.h names them since CUDA 11.7
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    raise CudaIpcError(f"the CUDA driver has none of {', '.join(names)}")


def driver() -> dict:
    """The driver functions that put memory operations and host functions on a stream
    (libcuda, which torch's CUDA runtime loaded already); CudaIpcError without them."""
    global _driver
    runtime()  # CUDA initialized: the driver is loaded and has a context (takes _lock)
    with _lock:
        if _driver is not None:
            return _driver_fns
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaIpcError(f"the CUDA driver library is not loadable: {e}") from None
        write = _driver_fn(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        wait = _driver_fn(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        for fn in (write, wait):
            fn.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
            fn.restype = ctypes.c_int
        host = _driver_fn(lib, "cuLaunchHostFunc")
        host.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        host.restype = ctypes.c_int
        copy = _driver_fn(lib, "cuMemcpyAsync")
        copy.argtypes = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
        copy.restype = ctypes.c_int
        # called from C only (Calls: kernels/csrc/graph_call.cu), by their addresses
        launch = _driver_fn(lib, "cuGraphLaunch")
        record = _driver_fn(lib, "cuEventRecord")
        sync = _driver_fn(lib, "cuEventSynchronize")
        event = _driver_fn(lib, "cuEventCreate")
        event.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
        event.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        _driver_fns.update(
            write=write,
            wait=wait,
            host=host,
            copy=copy,
            launch=launch,
            record=record,
            sync=sync,
            event=event,
            lib=lib,
        )
        _driver = lib
        return _driver_fns


def _check_driver(rc: int, what: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _driver_fns["lib"].cuGetErrorString(rc, ctypes.byref(text))
        name = text.value.decode(errors="replace") if text.value else "unknown error"
        raise CudaIpcError(f"{what}: {name} (CUDA driver error {rc})")


def write_value(stream: torch.cuda.Stream, device_ptr: int, value: int) -> None:
    """Queue on `stream`: store the u32 `value` at `device_ptr`, after a fence that makes
    the stream's earlier writes visible first (cuStreamWriteValue32's default)."""
    fns = _driver_fns or driver()
    _check_driver(fns["write"](stream.cuda_stream, device_ptr, value, 0), "cuStreamWriteValue32")


def wait_value(stream: torch.cuda.Stream, device_ptr: int, value: int, how: int = WAIT_EQ) -> None:
    """Queue on `stream`: wait until the u32 at `device_ptr` meets `value` (`how`)."""
    fns = _driver_fns or driver()
    _check_driver(fns["wait"](stream.cuda_stream, device_ptr, value, how), "cuStreamWaitValue32")


def copy(stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
    """Queue on `stream`: copy `nbytes` from address `src` to `dst` (device memory, or
    page-locked host memory: one address space), as torch's copy_ of two contiguous
    tensors of one dtype does, without its dispatch (10-18 us of host time a copy on
    the per-call path, docs/dataplane.md; this is one driver call)."""
    fns = _driver_fns or driver()
    _check_driver(fns["copy"](dst, src, nbytes, stream.cuda_stream), "cuMemcpyAsync")


def copy_into(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, queued on `stream`: one driver call (`copy`) where both are contiguous
    and alike (slots' rows, graph buffers, page-locked staging), torch's copy_ otherwise
    (another dtype or layout)."""
    if (
        dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        copy(stream, dst.data_ptr(), src.data_ptr(), dst.nbytes)
    else:
        with on_stream(stream):
            dst.copy_(src, non_blocking=True)


def host_call(stream: torch.cuda.Stream, fn: int, arg: int) -> None:
    """Queue on `stream`: run the C function `fn(arg)` (void (*)(void*)) on the driver's
    thread once the stream's earlier work is done (it must not call CUDA)."""
    fns = _driver_fns or driver()
    _check_driver(fns["host"](stream.cuda_stream, fn, arg), "cuLaunchHostFunc")


class Calls:
    """The driver's entry points for a per-call path written in C (kernels/csrc/
    graph_call.cu: a graph's launch, a 32-bit store, an event's record and wait, as
    cuGraphLaunch, cuStreamWriteValue32, cuEventRecord and cuEventSynchronize of the
    driver this process loaded), and events for it."""

    def __init__(self) -> None:
        fns = driver()
        self._event = fns["event"]

        def address(name: str) -> int:
            return ctypes.cast(fns[name], ctypes.c_void_p).value

        self.launch, self.write = address("launch"), address("write")
        self.record, self.sync = address("record"), address("sync")

    def event(self) -> int:
        """A new event (no timing); it lives as long as the process (a handful per
        server)."""
        handle = ctypes.c_void_p()
        _check_driver(self._event(ctypes.byref(handle), 0x2), "cuEventCreate")  # DISABLE_TIMING
        return handle.value
