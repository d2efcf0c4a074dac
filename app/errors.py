"""The domain errors of the service, and nothing else.

Every failure a client can cause or see is one of these; `app.api.errors` maps them to HTTP answers in
one place, so routes, codecs and the engine raise them and never build HTTP responses themselves::

    MatmulError                       500  internal_error
    ├── InvalidInput                  422  invalid_input
    │   ├── MalformedPayload          422  malformed_payload      body cannot be parsed (JSON, .npy, .npz, multipart)
    │   ├── InvalidMatrix             422  invalid_matrix         parsed, but not a 2-D numeric matrix
    │   ├── ShapeMismatch             422  shape_mismatch         inner dimensions differ, or a size limit is passed
    │   ├── UnknownKernel             422  unknown_kernel         not a kernel of this backend
    │   └── InvalidParameter          422  invalid_parameter      bad tile, dtype, or conflicting parameters
    ├── BadRequest                    400  bad_request            a request that contradicts itself (two Content-Types)
    │                                                             or the inference protocol (an infer id not a string)
    ├── NotFound                      404  not_found              a route that is switched off
    │   └── UnknownModel              404  unknown_model          inference protocol: no such model or version
    ├── Unauthorized                  401  unauthorized           no or wrong API key (sent with WWW-Authenticate)
    ├── BodyTimeout                   408  body_timeout           the body stopped arriving
    ├── HeaderTimeout                 408  header_timeout         the request's headers did not all arrive in time
    ├── HeadersTooLarge               431  headers_too_large      the request line and headers passed their limit
    ├── PayloadTooLarge               413  payload_too_large
    ├── UnsupportedMediaType          415  unsupported_media_type
    ├── NotAcceptable                 406  not_acceptable
    ├── ServiceUnavailable            503  service_unavailable    (sent with Retry-After)
    │   ├── Overloaded                503  overloaded             the worker's queue is full
    │   ├── NotReady                  503  not_ready              kernels still compiling, or the device failed
    │   ├── DeviceOutOfMemory         503  device_out_of_memory   the product does not fit in device memory now
    │   └── DeviceLost                503  device_lost            a sticky CUDA error: the process must restart
    ├── DeadlineExceeded              504  deadline_exceeded      still queued when the request's deadline passed
    ├── ClientGone                    499  client_gone            the client disconnected (nobody reads this answer)
    └── DeviceFailure                 500  device_failure         the device raised an error we did not expect

Library errors (NumPy, CuPy, CUDA, zipfile, ...) are translated into these with ``raise ... from exc``
where they happen, so the message names what was wrong and where (which matrix, row, dimension).
"""

from __future__ import annotations

from collections.abc import Sequence

Location = Sequence[str | int]


class MatmulError(Exception):
    """Base of every error the service reports to a client."""

    status_code: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, location: Location | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.location: list[str | int] | None = list(location) if location is not None else None


class InvalidInput(MatmulError):
    status_code = 422
    code = "invalid_input"


class MalformedPayload(InvalidInput):
    code = "malformed_payload"


class InvalidMatrix(InvalidInput):
    code = "invalid_matrix"


class ShapeMismatch(InvalidInput):
    code = "shape_mismatch"


class UnknownKernel(InvalidInput):
    code = "unknown_kernel"


class InvalidParameter(InvalidInput):
    code = "invalid_parameter"


class BadRequest(MatmulError):
    status_code = 400
    code = "bad_request"


class NotFound(MatmulError):
    status_code = 404
    code = "not_found"


class UnknownModel(NotFound):
    code = "unknown_model"


class Unauthorized(MatmulError):
    status_code = 401
    code = "unauthorized"


class BodyTimeout(MatmulError):
    status_code = 408
    code = "body_timeout"


class HeaderTimeout(MatmulError):
    status_code = 408
    code = "header_timeout"


class HeadersTooLarge(MatmulError):
    status_code = 431
    code = "headers_too_large"


class PayloadTooLarge(MatmulError):
    status_code = 413
    code = "payload_too_large"


class UnsupportedMediaType(MatmulError):
    status_code = 415
    code = "unsupported_media_type"


class NotAcceptable(MatmulError):
    status_code = 406
    code = "not_acceptable"


class ServiceUnavailable(MatmulError):
    status_code = 503
    code = "service_unavailable"


class Overloaded(ServiceUnavailable):
    code = "overloaded"


class NotReady(ServiceUnavailable):
    code = "not_ready"


class DeviceOutOfMemory(ServiceUnavailable):
    code = "device_out_of_memory"


class DeviceLost(ServiceUnavailable):
    code = "device_lost"


class DeadlineExceeded(MatmulError):
    status_code = 504
    code = "deadline_exceeded"


class ClientGone(MatmulError):
    status_code = 499
    code = "client_gone"


class DeviceFailure(MatmulError):
    code = "device_failure"
