"""matmul-service: matrix products on NVIDIA GPUs over HTTP."""

__version__ = "0.1.0"
