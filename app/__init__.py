"""matmul-service: matrix products on NVIDIA GPUs over HTTP."""
