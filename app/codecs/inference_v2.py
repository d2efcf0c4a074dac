"""The Open Inference Protocol v2 (KServe / Triton HTTP) for one model shape: inputs A (m x k), B (k x n), output C.

Decodes an infer request, JSON tensors (`data`, flat or nested, row-major) or Triton's binary tensor data
extension (the JSON header, then each binary input's raw little-endian bytes in order, the header's length
in `Inference-Header-Content-Length`, each tensor's size in `parameters.binary_data_size`), into the same
`Operands` the `/matmul` codecs produce; encodes C as JSON `data` or as binary data after the header.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from app.codecs.json import json_type
from app.codecs.operands import Body, Limits, Operands, RequestOptions, check_shape, declared_size
from app.errors import BadRequest, InvalidMatrix, InvalidParameter, MalformedPayload, SharedMemoryError
from app.shapes import OPERAND_DIMENSIONS
from app.shared_memory import Matrix, SharedOutput, SharedTensor
from matmul_client.wire import data_bytes
from numerics.precision import INT8_PRODUCT, Precision

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_MEDIA_TYPE = "application/octet-stream"
INPUTS = ("A", "B")
OUTPUT = "C"
DATATYPES: dict[str, np.dtype] = {
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "INT8": np.dtype("i1"),
}
"""The input datatypes: A and B both INT8 are multiplied exactly into INT32 (`_options`)."""
DATATYPE_OF = {"float32": "FP32", "float64": "FP64", INT8_PRODUCT: "INT32"}
"""C's datatype for each product dtype."""


@dataclass(frozen=True)
class InferRequest:
    """An infer request, decoded: the operands, the options, and how C is to be sent back."""

    id: str | None
    operands: Operands
    binary_output: bool
    output_region: SharedOutput | None = None
    """Where the client asked for C in its shared memory, if it did (C is then not in the answer)."""


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MalformedPayload(f"{where} must be a JSON object")
    return value


def _options(parameters: Mapping[str, Any], declared: list[str]) -> RequestOptions:
    kernel, tile, precision = parameters.get("kernel"), parameters.get("tile"), parameters.get("precision")
    for name, value in (("kernel", kernel), ("precision", precision)):
        if value is not None and not isinstance(value, str):
            raise InvalidParameter(f"parameters.{name} must be a string", location=["parameters", name])
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int)):
        raise InvalidParameter("parameters.tile must be an integer", location=["parameters", "tile"])
    if set(declared) == {"INT8"} or precision == Precision.INT8.value:
        dtype = INT8_PRODUCT  # the exact product; other datatypes' values must be int8's, checked as they are staged
    else:
        dtype = "float64" if "FP64" in declared else "float32"
    if precision is None and set(declared) == {"FP16"}:
        precision = Precision.FP16.value  # FP16 tensors' natural precision, whether sent as binary or JSON data
    return RequestOptions(kernel=kernel, tile=tile, dtype=dtype, precision=precision)


def _shape(tensor: Mapping[str, Any], name: str, limits: Limits) -> tuple[int, ...]:
    """An input's shape: two non-negative integers (a matrix), or three (a stack of matrices, its leading
    dimension the batch)."""
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) not in OPERAND_DIMENSIONS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise InvalidMatrix(
            f"input '{name}' must have a shape of two non-negative integers (a matrix) or three (a stack of "
            f"matrices, the batch first), got {shape!r}",
            location=[name],
        )
    check_shape(tuple(shape), name, limits)
    return tuple(shape)


def _json_tensor(data: Any, shape: tuple[int, ...], name: str, datatype: str, may_hold_booleans: bool) -> np.ndarray:
    """An input's JSON data as the array its datatype declares, as its binary data would be (`_in_datatype`)."""
    try:
        array = np.array(data)
    except ValueError:
        depth = _nesting(data)
        says = f"nested {depth} lists deep, more than an array has dimensions ({MAX_NESTING})"
        raise InvalidMatrix(
            f"input '{name}' data is {says if depth > MAX_NESTING else 'ragged'}", location=[name]
        ) from None
    if array.dtype.kind not in "iuf" and array.size:
        raise InvalidMatrix(f"input '{name}' data must be numbers, found {array.dtype.kind!r} values", location=[name])
    if may_hold_booleans and any(isinstance(x, bool) for x in np.ravel(np.array(data, dtype=object))):
        raise InvalidMatrix(f"input '{name}' data holds booleans, expected numbers", location=[name])
    if array.size != math.prod(shape):
        raise InvalidMatrix(
            f"input '{name}' has {array.size} values but its shape {list(shape)} needs {math.prod(shape)}",
            location=[name],
        )
    return _in_datatype(array.reshape(shape), name, datatype)


MAX_NESTING = 64
"""NumPy's most dimensions of an array: JSON data nested deeper is refused for that, not for being ragged."""


def _nesting(data: Any) -> int:
    """How many lists deep `data` is along its first elements."""
    depth = 0
    while isinstance(data, list) and data:
        data, depth = data[0], depth + 1
    return depth


def _in_datatype(values: np.ndarray, name: str, datatype: str) -> np.ndarray:
    """JSON numbers (or gRPC's typed contents) as the datatype their input declares, as its binary data would hold
    them: INT8 takes integers from -128 to 127, the floating types any number within their range (rounded to their
    nearest, as a client's own conversion to binary data would) and NaN and infinities as they are; any other is
    refused, naming its element, rather than multiplied as a value the input cannot hold."""
    dtype = DATATYPES[datatype]
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype.kind == "i":
            limits = np.iinfo(dtype)
            held = (values >= limits.min) & (values <= limits.max) & (values == np.trunc(values))
            converted = values.astype(dtype)
        else:  # NaN and infinities (gRPC's typed contents carry them; JSON cannot) are kept as sent, as in binary data
            converted = values.astype(dtype)
            held = np.isfinite(converted) | ~np.isfinite(values)
    if not held.all():
        where = [int(i) for i in np.unravel_index(int(np.argmin(held)), values.shape)]
        element = f"{name}{''.join(f'[{i}]' for i in where)} = {values[tuple(where)].item()!r}"
        if dtype.kind == "i":
            says = f"is not an int8 (an integer from {limits.min} to {limits.max})"
        else:
            says = f"is beyond {datatype}'s range (up to {np.finfo(dtype).max.item():g} in magnitude)"
        raise InvalidMatrix(f"input '{name}' is {datatype}: {element} {says}", location=[name, *where])
    return converted


def _header_length(value: str, body_size: int) -> int:
    """The JSON header's length: a size declared (`declared_size`) from 1 to the body's size."""
    declared = declared_size(value)
    if declared is not None and 0 < declared <= body_size:
        return declared
    raise MalformedPayload(
        f"{HEADER_LENGTH} is {value[:40]!r}{'...' if len(value) > 40 else ''}, but the body has {body_size} bytes",
        location=[HEADER_LENGTH],
    )


def decode_infer(body: Body, header_length: str | None, limits: Limits) -> InferRequest:
    """An infer request body (with the value of Inference-Header-Content-Length, if sent) -> InferRequest: its
    binary tensors as views of `body`."""
    if header_length is None:
        header, binary = (body if isinstance(body, bytes | bytearray) else bytes(body)), memoryview(b"")
    else:
        split = _header_length(header_length, len(body))
        header, binary = bytes(body[:split]), memoryview(body)[split:]
    try:
        doc = _object(orjson.loads(header), "the inference request")
    except orjson.JSONDecodeError as exc:
        raise MalformedPayload(f"the inference request is not valid JSON: {exc}") from exc
    following = _Following(binary)
    decoded = decode_infer_document(
        doc, following.take, limits, may_hold_booleans=b"true" in header or b"false" in header
    )
    if following.offset != len(binary):
        raise MalformedPayload(
            f"{len(binary) - following.offset} bytes of binary data follow the inputs and belong to none"
        )
    return decoded


class _Following:
    """The binary data after an HTTP request's JSON header: each binary input's bytes, one after the other."""

    def __init__(self, binary: memoryview) -> None:
        self.binary = binary
        self.offset = 0

    def take(self, name: str, nbytes: int) -> memoryview:
        if self.offset + nbytes > len(self.binary):
            raise MalformedPayload(
                f"input '{name}' needs {nbytes} bytes of binary data, only {len(self.binary) - self.offset} follow",
                location=[name],
            )
        taken = self.binary[self.offset : self.offset + nbytes]
        self.offset += nbytes
        return taken


def unsupported_datatype(name: str, datatype: Any) -> InvalidMatrix:
    """The refusal of an input whose datatype this model does not take."""
    return InvalidMatrix(
        f"input '{name}' has datatype {datatype!r}; this model takes {list(DATATYPES)}", location=[name]
    )


BinarySource = Callable[[str, int], memoryview]
"""The binary data of the input named, of the size its binary_data_size declares (checked against its shape)."""


def decode_infer_document(
    doc: Mapping[str, Any], binary: BinarySource, limits: Limits, may_hold_booleans: bool = True
) -> InferRequest:
    """An infer request in the protocol's JSON form (over HTTP, or the gRPC request read into it) -> InferRequest.
    An input whose parameters give binary_data_size has its bytes from `binary`; `may_hold_booleans` False spares
    looking for booleans in JSON data that cannot hold any."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):
        raise MalformedPayload("the inference request needs a list 'inputs' with tensors A and B", location=["inputs"])
    tensors = [_object(t, "each input") for t in inputs]
    names = [t.get("name") for t in tensors]
    if sorted(map(str, names)) != sorted(INPUTS):
        raise InvalidMatrix(f"inputs must be exactly {list(INPUTS)}, got {names}", location=["inputs"])

    arrays: dict[str, Matrix] = {}
    declared: list[str] = []
    for tensor in tensors:
        name = str(tensor["name"])
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise unsupported_datatype(name, datatype)
        declared.append(datatype)
        shape = _shape(tensor, name, limits)
        tensor_parameters = _object(tensor.get("parameters", {}), f"input '{name}' parameters")
        size = tensor_parameters.get("binary_data_size")
        shared = _shared_memory(tensor_parameters, f"input '{name}'", [name])
        if shared is not None:
            if "data" in tensor or size is not None:
                raise SharedMemoryError(
                    f"input '{name}' is in shared memory and must carry neither data nor binary_data_size",
                    location=[name],
                )
            region, region_offset, byte_size = shared
            if byte_size != _tensor_bytes(shape, datatype):
                message = _size_mismatch(name, shape, datatype, "shared_memory_byte_size", byte_size)
                raise SharedMemoryError(message, location=[name])
            arrays[name] = SharedTensor(region, region_offset, shape, DATATYPES[datatype])
            continue
        if size is not None and "data" in tensor:
            raise InvalidMatrix(
                f"input '{name}' carries both data and parameters.binary_data_size: send its values one way",
                location=[name],
            )
        if size is None:
            if "data" not in tensor:
                raise InvalidMatrix(f"input '{name}' has neither data nor parameters.binary_data_size", location=[name])
            arrays[name] = _json_tensor(tensor["data"], shape, name, datatype, may_hold_booleans)
            continue
        expected = _tensor_bytes(shape, datatype)
        if size != expected:
            raise MalformedPayload(_size_mismatch(name, shape, datatype, "binary_data_size", size), location=[name])
        arrays[name] = np.frombuffer(binary(name, expected), DATATYPES[datatype]).reshape(shape)

    parameters = _object(doc.get("parameters", {}), "parameters")
    binary_output = _flag(parameters, "binary_data_output", False, ["parameters", "binary_data_output"])
    outputs = doc.get("outputs")
    output_region = None
    if outputs is not None:
        if not isinstance(outputs, list) or [_object(o, "each output").get("name") for o in outputs] != [OUTPUT]:
            raise InvalidMatrix(f"outputs, when given, must be exactly [{OUTPUT!r}]", location=["outputs"])
        output_parameters = _object(outputs[0].get("parameters", {}), "output parameters")
        binary_output = _flag(output_parameters, "binary_data", binary_output, ["outputs", 0, "binary_data"])
        shared = _shared_memory(output_parameters, f"output '{OUTPUT}'", ["outputs", 0])
        if shared is not None:
            output_region = SharedOutput(*shared)
            _check_apart(output_region, arrays)
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest(f"the request's 'id' must be a string, got {json_type(request_id)}", location=["id"])
    return InferRequest(
        id=request_id,
        operands=Operands(a=arrays["A"], b=arrays["B"], options=_options(parameters, declared)),
        binary_output=binary_output,
        output_region=output_region,
    )


def _flag(parameters: Mapping[str, Any], name: str, default: bool, location: list[str | int]) -> bool:
    """A boolean parameter: true or false, never a string or a number read as one ("false" is a true string)."""
    value = parameters.get(name, default)
    if not isinstance(value, bool):
        raise InvalidParameter(f"{name} must be true or false, got {value!r}", location=location)
    return value


def _check_apart(output: SharedOutput, inputs: Mapping[str, Matrix]) -> None:
    """C's window must not share a byte with an input's in the same region: a kernel writing C there would overwrite
    an operand it has still to read, and the answer would depend on the kernel's order of work."""
    for name, tensor in sorted(inputs.items()):
        if not isinstance(tensor, SharedTensor) or tensor.region != output.region:
            continue
        start, end = tensor.offset, tensor.offset + math.prod(tensor.shape) * tensor.dtype.itemsize
        if max(start, output.offset) < min(end, output.offset + output.byte_size):
            raise SharedMemoryError(
                f"output '{OUTPUT}' at bytes {output.offset} to {output.offset + output.byte_size} of region "
                f"'{output.region}' overlaps input '{name}' at bytes {start} to {end}: the product would overwrite "
                "an operand it reads; place C apart from its inputs",
                location=["outputs", 0],
            )


def _tensor_bytes(shape: tuple[int, ...], datatype: str) -> int:
    return math.prod(shape) * DATATYPES[datatype].itemsize


def _size_mismatch(name: str, shape: tuple[int, ...], datatype: str, parameter: str, given: Any) -> str:
    return (
        f"input '{name}' is {'x'.join(map(str, shape))} {datatype} ({_tensor_bytes(shape, datatype)} bytes), but "
        f"its {parameter} is {given!r}"
    )


def _shared_memory(parameters: Mapping[str, Any], what: str, location: list[str | int]) -> tuple[str, int, int] | None:
    """(region, offset, byte_size) when a tensor's parameters place it in shared memory; region and byte size come
    together, the offset is 0 unless given."""
    region = parameters.get("shared_memory_region")
    byte_size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if region is None and byte_size is None:
        if "shared_memory_offset" in parameters:
            raise SharedMemoryError(f"{what} has a shared_memory_offset but no shared_memory_region", location=location)
        return None
    if region is None or byte_size is None:
        raise SharedMemoryError(
            f"{what} needs both shared_memory_region and shared_memory_byte_size, or neither", location=location
        )
    if not isinstance(region, str) or not region:
        raise SharedMemoryError(f"{what}: shared_memory_region must be a region's name", location=location)
    for name, value in (("shared_memory_byte_size", byte_size), ("shared_memory_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SharedMemoryError(f"{what}: {name} must be a byte count, got {value!r}", location=location)
    return region, offset, byte_size


def encode_infer(
    c: np.ndarray, model: str, request_id: str | None, binary: bool, parameters: Mapping[str, Any]
) -> tuple[bytes, memoryview | None]:
    """The infer response's JSON header, and C's bytes to send after it when the answer is binary (a view of C,
    not a copy: the header's length goes in Inference-Header-Content-Length)."""
    output: dict[str, Any] = {"name": OUTPUT, "datatype": DATATYPE_OF[c.dtype.name], "shape": list(c.shape)}
    if binary:
        output["parameters"] = {"binary_data_size": c.nbytes}
    else:
        output["data"] = c.reshape(-1)
    header = _response(output, model, request_id, parameters)
    if not binary:
        return header, None
    return header, data_bytes(c)


def encode_infer_in_region(
    shape: tuple[int, ...],
    dtype: np.dtype,
    region: SharedOutput,
    model: str,
    request_id: str | None,
    parameters: Mapping[str, Any],
) -> bytes:
    """The infer response body when C was written into the client's shared-memory region: C's description, and
    where it lies, without its data."""
    output = {
        "name": OUTPUT,
        "datatype": DATATYPE_OF[dtype.name],
        "shape": list(shape),
        "parameters": {
            "shared_memory_region": region.region,
            "shared_memory_offset": region.offset,
            "shared_memory_byte_size": math.prod(shape) * dtype.itemsize,
        },
    }
    return _response(output, model, request_id, parameters)


def _response(output: dict[str, Any], model: str, request_id: str | None, parameters: Mapping[str, Any]) -> bytes:
    response: dict[str, Any] = {
        "model_name": model,
        "model_version": "1",
        "outputs": [output],
        "parameters": dict(parameters),
    }
    if request_id is not None:
        response["id"] = request_id
    return orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
