"""matmul-client: the Python client and CLI of matmul-service, with NumPy and httpx only.

from matmul_client import MatmulClient

with MatmulClient("http://gpu-box:8000") as client:
    c = client.matmul(a, b)
"""

from matmul_client.client import (
    AsyncMatmulClient,
    MatmulClient,
    MatmulServiceError,
    Options,
    Product,
    RequestFormat,
    RequestRejected,
    ServerError,
    Unavailable,
)

__version__ = "0.1.0"
__all__ = [
    "AsyncMatmulClient",
    "MatmulClient",
    "MatmulServiceError",
    "Options",
    "Product",
    "RequestFormat",
    "RequestRejected",
    "ServerError",
    "Unavailable",
]
