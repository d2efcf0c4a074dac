"""The domain errors of the service, and nothing else.

Every failure a client can cause or see is one of these, with a stable `code` that names it on every surface
(the answer's body, the logs). Nothing here knows HTTP: `app.api.errors` holds the one table from these classes
to HTTP statuses, so the service, the codecs and the engine raise them and never build HTTP answers::

    MatmulError                   internal_error
    ├── InvalidInput              invalid_input
    │   ├── MalformedPayload      malformed_payload      body cannot be parsed (JSON, .npy, .npz, multipart)
    │   ├── InvalidMatrix         invalid_matrix         parsed, but not a 2-D numeric matrix
    │   ├── ShapeMismatch         shape_mismatch         inner dimensions differ, or a size limit is passed
    │   ├── UnknownKernel         unknown_kernel         not a kernel of this backend
    │   └── InvalidParameter      invalid_parameter      bad tile, dtype, or conflicting parameters
    ├── BadRequest                bad_request            a request that contradicts itself (two Content-Types)
    │   │                                                or the inference protocol (an infer id not a string)
    │   └── SharedMemoryError     shared_memory          a shared-memory region misused: unknown, a duplicate
    │                                                    name, a window outside it, a size that does not match
    ├── NotFound                  not_found              a route that is switched off
    │   └── UnknownModel          unknown_model          inference protocol: no such model or version
    ├── Unauthorized              unauthorized           no or wrong API key (sent with WWW-Authenticate)
    ├── BodyTimeout               body_timeout           the body stopped arriving
    ├── HeaderTimeout             header_timeout         the request's headers did not all arrive in time
    ├── HeadersTooLarge           headers_too_large      the request line and headers passed their limit
    ├── PayloadTooLarge           payload_too_large
    ├── UnsupportedMediaType      unsupported_media_type
    ├── NotAcceptable             not_acceptable
    ├── ServiceUnavailable        service_unavailable    (sent with Retry-After)
    │   ├── Overloaded            overloaded             the worker's queue is full
    │   ├── NotReady              not_ready              kernels still compiling, or the device failed
    │   ├── DeviceOutOfMemory     device_out_of_memory   the product does not fit in device memory now
    │   ├── DeviceLost            device_lost            a sticky CUDA error: the process must restart
    │   └── EngineUnresponsive    engine_unresponsive    the engine process has said nothing for too long
    ├── DeadlineExceeded          deadline_exceeded      still queued when the request's deadline passed
    ├── ClientGone                client_gone            the client disconnected (nobody reads this answer)
    └── DeviceFailure             device_failure         the device raised an error we did not expect

Library errors (NumPy, CuPy, CUDA, zipfile, ...) are translated into these with ``raise ... from exc``
where they happen, so the message names what was wrong and where (which matrix, row, dimension).
"""

from __future__ import annotations

from collections.abc import Sequence

Location = Sequence[str | int]


class MatmulError(Exception):
    """Base of every error the service reports to a client."""

    code: str = "internal_error"

    def __init__(self, message: str, *, location: Location | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.location: list[str | int] | None = list(location) if location is not None else None


class InvalidInput(MatmulError):
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
    code = "bad_request"


class SharedMemoryError(BadRequest):
    code = "shared_memory"


class NotFound(MatmulError):
    code = "not_found"


class UnknownModel(NotFound):
    code = "unknown_model"


class Unauthorized(MatmulError):
    code = "unauthorized"


class BodyTimeout(MatmulError):
    code = "body_timeout"

    @classmethod
    def after(cls, timeout_s: float, received: int) -> BodyTimeout:
        return cls(f"the body stopped arriving: nothing for {timeout_s:g} s after {received} bytes")


class HeaderTimeout(MatmulError):
    code = "header_timeout"


class HeadersTooLarge(MatmulError):
    code = "headers_too_large"


class PayloadTooLarge(MatmulError):
    code = "payload_too_large"


class UnsupportedMediaType(MatmulError):
    code = "unsupported_media_type"


class NotAcceptable(MatmulError):
    code = "not_acceptable"


class ServiceUnavailable(MatmulError):
    code = "service_unavailable"


class Overloaded(ServiceUnavailable):
    code = "overloaded"


class NotReady(ServiceUnavailable):
    code = "not_ready"


class DeviceOutOfMemory(ServiceUnavailable):
    code = "device_out_of_memory"


class DeviceLost(ServiceUnavailable):
    code = "device_lost"


class EngineUnresponsive(ServiceUnavailable):
    code = "engine_unresponsive"


class DeadlineExceeded(MatmulError):
    code = "deadline_exceeded"


class ClientGone(MatmulError):
    code = "client_gone"


class DeviceFailure(MatmulError):
    code = "device_failure"


def _classes_by_code(root: type[MatmulError]) -> dict[str, type[MatmulError]]:
    found = {root.code: root}
    for subclass in root.__subclasses__():
        found.update(_classes_by_code(subclass))
    return found


def error_of(code: str, message: str, location: Location | None = None) -> MatmulError:
    """The error named by `code` (as another process reported it), as the class that raised it there; an
    unknown code is an internal error."""
    return _classes_by_code(MatmulError).get(code, MatmulError)(message, location=location)
