"""Finding a backend by name. The compiled `cuda` backend is imported on first
lookup when its module is present; importing it registers it in backend.py."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from expertd.kernels.backend import Backend, registered


def backend_names() -> list[str]:
    _load_optional()
    return sorted(registered())


def default_backend_name(device: torch.device) -> str:
    _load_optional()
    return "cuda" if device.type == "cuda" and "cuda" in registered() else "reference"


def create_backend(name: str, device: torch.device | str) -> Backend:
    """Build backend `name` on `device`; a clear error for an unknown or unusable pair."""
    device = torch.device(device)
    _load_optional()
    factories = registered()
    if name not in factories:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(factories))}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda requested but torch sees no CUDA device")
    return factories[name](device)


def _load_optional() -> None:
    """Register the compiled backend when its module is present (it registers itself)."""
    if "cuda" not in registered() and importlib.util.find_spec("expertd.kernels.cuda") is not None:
        importlib.import_module("expertd.kernels.cuda")
