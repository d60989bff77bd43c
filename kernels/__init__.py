"""The math of expertd: NVFP4 codec, plain-torch reference, backends."""

from expertd.kernels.backend import Backend, ReferenceBackend
from expertd.kernels.layer import ShardLayer
from expertd.kernels.lookup import backend_names, create_backend
from expertd.kernels.nvfp4 import Nvfp4Weight, dequantize, quantize
from expertd.kernels.reference import reference_forward, relative_error

__all__ = [
    "Backend",
    "Nvfp4Weight",
    "ReferenceBackend",
    "ShardLayer",
    "backend_names",
    "create_backend",
    "dequantize",
    "quantize",
    "reference_forward",
    "relative_error",
]
