"""Finding a backend by name, and choosing one for a device. The compiled `cuda` backend is
imported on first lookup when its module is present; importing it registers it in backend.py.

The compiled kernels are built for sm_90a, which runs on compute capability 9.0 only (H100,
H200): on any other GPU (an A100 is 8.0, a B200 10.0) the default is the torch reference, and
asking for `cuda` there is refused with the reason. The choice and its reason are logged once,
in one line, and kept in `last_choice()`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from expertd.kernels.backend import Backend, registered
from expertd.kernels.build import capability_problem

log = logging.getLogger("expertd.kernels")

_LAST_CHOICE: tuple[str, str] | None = None


def backend_names() -> list[str]:
    _load_optional()
    return sorted(registered())


def cuda_unsupported(device: torch.device | str) -> str | None:
    """Why the compiled kernels cannot run on `device` (None: they can, as far as the device
    goes; the library still has to be found or built)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the compiled kernels run on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    where = f"{device} ({torch.cuda.get_device_name(device)})"
    return capability_problem(where, torch.cuda.get_device_capability(device))


def _no_library() -> str | None:
    """Why no kernel library can be had here (None: a prebuilt one is named, or nvcc exists)."""
    from expertd.kernels.build import find_nvcc, prebuilt_library

    if prebuilt_library() is not None:
        return None
    try:
        find_nvcc()
    except RuntimeError as e:
        return str(e)
    return None


def choose_backend(device: torch.device | str) -> tuple[str, str]:
    """-> (backend name, one-line reason) for `device` when none is named."""
    device = torch.device(device)
    _load_optional()
    if device.type != "cuda":
        return "reference", f"device {device.type}: the compiled kernels need a CUDA device"
    if "cuda" not in registered():
        return "reference", "the cuda backend module is not installed"
    why = cuda_unsupported(device) or _no_library()
    if why:
        return "reference", why
    return "cuda", f"{device} ({torch.cuda.get_device_name(device)}) runs the compiled kernels"


def default_backend_name(device: torch.device) -> str:
    """The backend for `device` when none is named; logs which one and why (one line)."""
    global _LAST_CHOICE
    name, reason = choose_backend(device)
    _LAST_CHOICE = (name, reason)
    slow = name == "reference" and torch.device(device).type == "cuda"
    log.log(logging.WARNING if slow else logging.INFO, "backend %s: %s", name, reason)
    return name


def last_choice() -> tuple[str, str] | None:
    """(name, reason) of the last default_backend_name() call in this process, if any."""
    return _LAST_CHOICE


def create_backend(name: str, device: torch.device | str) -> Backend:
    """Build backend `name` on `device`; a clear error for an unknown or unusable pair."""
    device = torch.device(device)
    _load_optional()
    factories = registered()
    if name not in factories:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(factories))}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but torch sees no CUDA device")
    if name == "cuda":
        why = cuda_unsupported(device)
        if why:
            raise ValueError(f"backend cuda: {why}; use backend reference")
    return factories[name](device)


def _load_optional() -> None:
    """Register the compiled backend when its module is present (it registers itself)."""
    if "cuda" not in registered() and importlib.util.find_spec("expertd.kernels.cuda") is not None:
        importlib.import_module("expertd.kernels.cuda")
