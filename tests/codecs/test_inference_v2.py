"""The v2 infer request's decoder, refusal by refusal: each error's class, its whole message (what a client reads:
which input, which value, which limit) and its location; and the response's encoding, field by field."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import orjson
import pytest

from app.codecs.inference_v2 import decode_infer, decode_infer_document, encode_infer, encode_infer_in_region
from app.codecs.operands import Limits, RequestOptions
from app.errors import MatmulError
from app.shared_memory import SharedOutput, SharedTensor

LIMITS = Limits(max_dim=8, max_elements=40, max_result_elements=64)
A = {"name": "A", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}
B = {"name": "B", "datatype": "FP32", "shape": [3, 1], "data": [1, 2, 3]}


def doc(*inputs: dict[str, Any], **fields: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs or (A, B)), **fields})


def refusal(body: bytes, header_length: str | None = None) -> tuple[str, str, list[str | int] | None]:
    with pytest.raises(MatmulError) as caught:
        decode_infer(body, header_length, LIMITS)
    return caught.value.code, caught.value.message, caught.value.location


def test_json_tensors_and_defaults() -> None:
    request = decode_infer(doc(), None, LIMITS)
    assert request.id is None and request.binary_output is False
    np.testing.assert_array_equal(request.operands.a, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(request.operands.b, [[1], [2], [3]])
    assert request.operands.options == RequestOptions(kernel=None, tile=None, dtype="float32")


def test_options_from_the_parameters_and_the_datatypes() -> None:
    b64 = {**B, "datatype": "FP64"}
    request = decode_infer(doc(A, b64, parameters={"kernel": "numpy", "tile": 16}, id="r1"), None, LIMITS)
    assert request.operands.options == RequestOptions(kernel="numpy", tile=16, dtype="float64")
    assert request.id == "r1"


@pytest.mark.parametrize(
    ("datatypes", "parameters", "expected"),
    [
        (("FP16", "FP16"), {}, RequestOptions(dtype="float32", precision="fp16")),
        (("FP16", "FP16"), {"precision": "fp32"}, RequestOptions(dtype="float32", precision="fp32")),
        (("FP16", "FP32"), {}, RequestOptions(dtype="float32")),
        (("FP16", "FP64"), {}, RequestOptions(dtype="float64")),
    ],
)
def test_two_fp16_inputs_ask_for_their_natural_precision_unless_one_is_named(
    datatypes: tuple[str, str], parameters: dict[str, str], expected: RequestOptions
) -> None:
    inputs = ({**A, "datatype": datatypes[0]}, {**B, "datatype": datatypes[1]})
    assert decode_infer(doc(*inputs, parameters=parameters), None, LIMITS).operands.options == expected


def test_fp16_binary_inputs_are_read_as_float16() -> None:
    a, b = np.array([[0.1, 2.0, -3.5]], np.float16), np.array([[1.0], [65504.0], [2.0**-24]], np.float16)
    inputs = [
        {"name": name, "datatype": "FP16", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
        for name, x in (("A", a), ("B", b))
    ]
    header = orjson.dumps({"inputs": inputs})
    request = decode_infer(header + a.astype("<f2").tobytes() + b.astype("<f2").tobytes(), str(len(header)), LIMITS)
    for decoded, sent in ((request.operands.a, a), (request.operands.b, b)):
        assert decoded.dtype == np.dtype("<f2")
        np.testing.assert_array_equal(decoded, sent)


def test_binary_inputs_in_lent_memory_are_views_of_it() -> None:
    """A body read into the engine's shared memory comes as a memoryview: the tensors are views of it, and a
    boolean word in the JSON header is still found."""
    a, b = np.arange(6, dtype="<f4").reshape(2, 3), np.arange(3, dtype="<f4").reshape(3, 1)
    inputs = [
        {"name": name, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
        for name, x in (("A", a), ("B", b))
    ]
    header = orjson.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}})
    memory = np.frombuffer(bytearray(header + a.tobytes() + b.tobytes()), np.uint8)
    request = decode_infer(memory.data, str(len(header)), LIMITS)
    assert request.binary_output
    for decoded, sent in ((request.operands.a, a), (request.operands.b, b)):
        np.testing.assert_array_equal(decoded, sent)
        assert np.shares_memory(decoded, memory)


@pytest.mark.parametrize(
    ("parameters", "outputs", "binary"),
    [
        ({}, None, False),
        ({"binary_data_output": True}, None, True),
        ({"binary_data_output": True}, [{"name": "C"}], True),
        ({"binary_data_output": True}, [{"name": "C", "parameters": {"binary_data": False}}], False),
        ({}, [{"name": "C", "parameters": {"binary_data": True}}], True),
        ({}, [{"name": "C"}], False),
    ],
)
def test_binary_output_is_asked_for_in_the_parameters_or_the_output(
    parameters: dict[str, Any], outputs: list[dict[str, Any]] | None, binary: bool
) -> None:
    fields: dict[str, Any] = {"parameters": parameters} | ({"outputs": outputs} if outputs is not None else {})
    assert decode_infer(doc(**fields), None, LIMITS).binary_output is binary


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None, [True]])
def test_binary_output_flags_must_be_booleans(value: Any) -> None:
    """The string "false" is not false: a flag that is not a boolean is refused, never read for its truth."""
    assert refusal(doc(parameters={"binary_data_output": value})) == (
        "invalid_parameter",
        f"binary_data_output must be true or false, got {value!r}",
        ["parameters", "binary_data_output"],
    )
    assert refusal(doc(outputs=[{"name": "C", "parameters": {"binary_data": value}}])) == (
        "invalid_parameter",
        f"binary_data must be true or false, got {value!r}",
        ["outputs", 0, "binary_data"],
    )


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({"kernel": 3}, ("invalid_parameter", "parameters.kernel must be a string", ["parameters", "kernel"])),
        ({"tile": "16"}, ("invalid_parameter", "parameters.tile must be an integer", ["parameters", "tile"])),
        ({"tile": True}, ("invalid_parameter", "parameters.tile must be an integer", ["parameters", "tile"])),
        ({"tile": 1.5}, ("invalid_parameter", "parameters.tile must be an integer", ["parameters", "tile"])),
    ],
)
def test_option_types(parameters: dict[str, Any], expected: tuple[str, str, list[str]]) -> None:
    assert refusal(doc(parameters=parameters)) == expected


@pytest.mark.parametrize(
    "shape", [[2, -3], [True, 3], [2, 3.0], [2], [1, 2, 3, 1], "2x3", None, [2, False], [2, 2, -1]]
)
def test_a_shape_must_be_two_or_three_non_negative_integers(shape: Any) -> None:
    assert refusal(doc({**A, "shape": shape}, B)) == (
        "invalid_matrix",
        "input 'A' must have a shape of two non-negative integers (a matrix) or three (a stack of matrices, the "
        f"batch first), got {shape!r}",
        ["A"],
    )


def test_zero_rows_are_a_shape() -> None:
    request = decode_infer(doc({**A, "shape": [0, 3], "data": []}, B), None, LIMITS)
    assert request.operands.a.shape == (0, 3)


def test_a_shape_over_the_limits_names_the_limit() -> None:
    assert refusal(doc({**A, "shape": [9, 3]}, B)) == (
        "shape_mismatch",
        "dimension 0 of 'A' is 9, over the limit of 8",
        ["A"],
    )
    assert refusal(doc(A, {**B, "shape": [8, 6]})) == (
        "shape_mismatch",
        "matrix 'B' has 48 elements, over the limit of 40",
        ["B"],
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([[1, 2, 3], [4, 5]], "input 'A' data is ragged"),
        (
            functools.reduce(lambda inner, _: [inner], range(65), [1]),
            "input 'A' data is nested 66 lists deep, more than an array has dimensions (64)",
        ),
        (["1", "2", "3", "4", "5", "6"], "input 'A' data must be numbers, found 'U' values"),
        ([1, 2, 3, 4, 5, True], "input 'A' data holds booleans, expected numbers"),
        ([1, 2, 3, 4, 5], "input 'A' has 5 values but its shape [2, 3] needs 6"),
        ([[1, 2, 3], [4, 5, 6], [7, 8, 9]], "input 'A' has 9 values but its shape [2, 3] needs 6"),
    ],
)
def test_json_data_refusals(data: Any, message: str) -> None:
    assert refusal(doc({**A, "data": data}, B)) == ("invalid_matrix", message, ["A"])


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("FP16", [0.1, -2.0, 65504.0, 2.0**-24, 1e-9, 3.0]),
        ("FP32", [0.1, -2.0, 3.4e38, 1e-45, 1.0 / 3.0, 7.0]),
        ("FP64", [0.1, -2.0, 1e300, 5e-324, 1.0 / 3.0, 7.0]),
        ("INT8", [-128, 127, 0, 1, -1, 5]),
    ],
)
def test_json_data_is_the_array_its_binary_data_would_be(datatype: str, values: list[float]) -> None:
    """A client's values in JSON decode to what the same values in the input's datatype sent as binary data do:
    the datatype's own, rounded as the client's conversion would round them (0.1 in FP32 is 0.100000001490116...,
    in FP16 0.0999755859375), beside another input of any datatype."""
    dtype = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8", "INT8": "i1"}[datatype]
    typed = np.array(values, dtype).reshape(2, 3)
    a_json = {"name": "A", "datatype": datatype, "shape": [2, 3], "data": values}
    a_binary = {"name": "A", "datatype": datatype, "shape": [2, 3], "parameters": {"binary_data_size": typed.nbytes}}
    for other in ("FP64", "FP32"):
        b = {**B, "datatype": other}
        from_json = decode_infer(doc(a_json, b), None, LIMITS).operands.a
        header = doc(a_binary, b)
        from_binary = decode_infer(header + typed.tobytes(), str(len(header)), LIMITS).operands.a
        assert isinstance(from_json, np.ndarray) and isinstance(from_binary, np.ndarray)
        assert from_json.dtype == from_binary.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(from_json, from_binary)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_nan_and_infinities_in_typed_contents_are_kept_as_binary_data_keeps_them(datatype: str) -> None:
    """JSON cannot carry them, gRPC's typed contents can: they are values of the floating types, not out of range."""
    values = [float("nan"), float("inf"), float("-inf"), 1.0, 65504.0, -2.5]
    document = {"inputs": [{**A, "datatype": datatype, "data": values}, B]}
    a = decode_infer_document(document, lambda name, size: memoryview(b""), LIMITS).operands.a
    dtype = {"FP16": "<f2", "FP32": "<f4", "FP64": "<f8"}[datatype]
    assert isinstance(a, np.ndarray) and a.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a, np.array(values, dtype).reshape(2, 3))


@pytest.mark.parametrize(
    ("datatype", "data", "message", "where"),
    [
        ("INT8", [1, 2, 3, 4, 1000, 6], "A[1][1] = 1000 is not an int8 (an integer from -128 to 127)", [1, 1]),
        ("INT8", [1, -129, 3, 4, 5, 6], "A[0][1] = -129 is not an int8 (an integer from -128 to 127)", [0, 1]),
        ("INT8", [1, 2, 1.5, 4, 5, 6], "A[0][2] = 1.5 is not an int8 (an integer from -128 to 127)", [0, 2]),
        (
            "FP16",
            [100000, 0.1, 3, 4, 5, 6],
            "A[0][0] = 100000.0 is beyond FP16's range (up to 65504 in magnitude)",
            [0, 0],
        ),
        ("FP16", [1, 2, 3, 4, 5, -65520], "A[1][2] = -65520 is beyond FP16's range (up to 65504 in magnitude)", [1, 2]),
        (
            "FP32",
            [1, 2, 3, 1e39, 5, 6],
            "A[1][0] = 1e+39 is beyond FP32's range (up to 3.40282e+38 in magnitude)",
            [1, 0],
        ),
    ],
)
def test_json_data_its_datatype_cannot_hold_is_refused(
    datatype: str, data: list[float], message: str, where: list[int]
) -> None:
    """Next to an input of another datatype too (no int8 product to check them when they are staged): a value
    the declared datatype cannot hold is refused where it is, never multiplied as sent or wrapped."""
    for other in ("FP32", "FP64"):
        body = doc({**A, "datatype": datatype, "data": data}, {**B, "datatype": other})
        assert refusal(body) == ("invalid_matrix", f"input 'A' is {datatype}: {message}", ["A", *where])


def test_an_input_with_both_data_and_a_binary_size_is_refused() -> None:
    """Its values one way only: the binary data would silently win over the JSON data sent beside it."""
    a = {**A, "parameters": {"binary_data_size": 24}}
    header = doc(a, B)
    body = header + np.full((2, 3), 9.0, np.float32).tobytes()
    with pytest.raises(MatmulError) as caught:
        decode_infer(body, str(len(header)), LIMITS)
    assert (caught.value.code, caught.value.message, caught.value.location) == (
        "invalid_matrix",
        "input 'A' carries both data and parameters.binary_data_size: send its values one way",
        ["A"],
    )


def test_nested_json_data_is_read_row_major() -> None:
    request = decode_infer(doc({**A, "data": [[1, 2, 3], [4, 5, 6]]}, B), None, LIMITS)
    np.testing.assert_array_equal(request.operands.a, [[1, 2, 3], [4, 5, 6]])


def test_true_in_a_string_does_not_refuse_numbers() -> None:
    """The boolean check runs only where the header has 'true' or 'false'; numbers are numbers wherever it runs."""
    request = decode_infer(doc(id="true"), None, LIMITS)
    np.testing.assert_array_equal(request.operands.b, [[1], [2], [3]])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"[1]", ("malformed_payload", "the inference request must be a JSON object", None)),
        (
            orjson.dumps({"inputs": {"A": 1}}),
            ("malformed_payload", "the inference request needs a list 'inputs' with tensors A and B", ["inputs"]),
        ),
        (orjson.dumps({"inputs": [A, 1]}), ("malformed_payload", "each input must be a JSON object", None)),
        (doc(A), ("invalid_matrix", "inputs must be exactly ['A', 'B'], got ['A']", ["inputs"])),
        (
            doc(A, {**B, "name": "C"}),
            ("invalid_matrix", "inputs must be exactly ['A', 'B'], got ['A', 'C']", ["inputs"]),
        ),
        (
            doc(A, {**B, "datatype": "INT32"}),
            (
                "invalid_matrix",
                "input 'B' has datatype 'INT32'; this model takes ['FP16', 'FP32', 'FP64', 'INT8']",
                ["B"],
            ),
        ),
        (
            doc(A, {k: v for k, v in B.items() if k != "data"}),
            ("invalid_matrix", "input 'B' has neither data nor parameters.binary_data_size", ["B"]),
        ),
        (doc(A, {**B, "parameters": 1}), ("malformed_payload", "input 'B' parameters must be a JSON object", None)),
        (doc(parameters=[1]), ("malformed_payload", "parameters must be a JSON object", None)),
        (doc(outputs=[{"name": "D"}]), ("invalid_matrix", "outputs, when given, must be exactly ['C']", ["outputs"])),
        (doc(outputs={"name": "C"}), ("invalid_matrix", "outputs, when given, must be exactly ['C']", ["outputs"])),
        (
            doc(outputs=[{"name": "C"}, {"name": "C"}]),
            ("invalid_matrix", "outputs, when given, must be exactly ['C']", ["outputs"]),
        ),
        (doc(outputs=[1]), ("malformed_payload", "each output must be a JSON object", None)),
        (
            doc(outputs=[{"name": "C", "parameters": 2}]),
            ("malformed_payload", "output parameters must be a JSON object", None),
        ),
        (doc(id=7), ("bad_request", "the request's 'id' must be a string, got a number", ["id"])),
    ],
)
def test_request_refusals(body: bytes, expected: tuple[str, str, list[str] | None]) -> None:
    assert refusal(body) == expected


def test_invalid_json_says_so() -> None:
    code, message, location = refusal(b"{")
    assert (code, location) == ("malformed_payload", None)
    assert message.startswith("the inference request is not valid JSON: ")


def binary_request(a: np.ndarray, b: np.ndarray, sizes: tuple[Any, Any] | None = None) -> tuple[bytes, str]:
    """A request with both inputs as binary data; `sizes` replaces their binary_data_size."""
    declared = sizes or (a.nbytes, b.nbytes)
    inputs = [
        {"name": name, "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": size}}
        for name, x, size in zip("AB", (a, b), declared, strict=True)
    ]
    header = orjson.dumps({"inputs": inputs})
    return header + a.astype("<f4").tobytes() + b.astype("<f4").tobytes(), str(len(header))


def test_binary_inputs_are_read_in_order() -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(3, dtype=np.float32).reshape(3, 1) + 10
    request = decode_infer(*binary_request(a, b), LIMITS)
    np.testing.assert_array_equal(request.operands.a, a)
    np.testing.assert_array_equal(request.operands.b, b)


def test_binary_framing_refusals() -> None:
    a, b = np.ones((2, 3), np.float32), np.ones((3, 1), np.float32)
    assert refusal(*binary_request(a, b, (24, 13))) == (
        "malformed_payload",
        "input 'B' is 3x1 FP32 (12 bytes), but its binary_data_size is 13",
        ["B"],
    )
    body, length = binary_request(a, b)
    assert refusal(body[:-1], length) == (
        "malformed_payload",
        "input 'B' needs 12 bytes of binary data, only 11 follow",
        ["B"],
    )
    assert refusal(body + b"xyz", length) == (
        "malformed_payload",
        "3 bytes of binary data follow the inputs and belong to none",
        None,
    )


@pytest.mark.parametrize("value", ["0", "", "-5", "+5", "5.0", "²", "1e3", "0x10"])
def test_a_header_length_that_is_not_a_positive_count_is_refused(value: str) -> None:
    body = doc()
    assert refusal(body, value) == (
        "malformed_payload",
        f"Inference-Header-Content-Length is {value!r}, but the body has {len(body)} bytes",
        ["Inference-Header-Content-Length"],
    )


def test_the_header_length_is_at_most_the_body() -> None:
    body = doc()
    size = len(body)
    assert decode_infer(body, str(size), LIMITS).operands.a.shape == (2, 3)
    assert decode_infer(body, f"000{size}", LIMITS).operands.a.shape == (2, 3)
    for value in (str(size + 1), "1" + "0" * len(str(size)), "9" * (len(str(size)) + 1)):
        assert refusal(body, value)[1] == f"Inference-Header-Content-Length is {value!r}, but the body has {size} bytes"


def test_the_header_length_splits_header_from_binary_data() -> None:
    a = np.ones((2, 3), np.float32)
    inputs = [{"name": "A", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}, B]
    header = orjson.dumps({"inputs": inputs})
    request = decode_infer(header + a.tobytes(), str(len(header)), LIMITS)
    np.testing.assert_array_equal(request.operands.a, a)
    assert refusal(header + a.tobytes(), str(len(header) - 1))[0] == "malformed_payload"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_encode_json(dtype: str) -> None:
    c = np.arange(6, dtype=dtype).reshape(2, 3)
    body, data = encode_infer(c, "matmul", "r1", False, {"kernel": "numpy"})
    assert data is None
    assert orjson.loads(body) == {
        "model_name": "matmul",
        "model_version": "1",
        "id": "r1",
        "outputs": [
            {
                "name": "C",
                "datatype": {"float32": "FP32", "float64": "FP64"}[dtype],
                "shape": [2, 3],
                "data": [0, 1, 2, 3, 4, 5],
            }
        ],
        "parameters": {"kernel": "numpy"},
    }


def test_encode_binary() -> None:
    c = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    header_bytes, data = encode_infer(c, "m", None, True, {})
    assert data is not None
    header = orjson.loads(header_bytes)
    assert header == {
        "model_name": "m",
        "model_version": "1",
        "outputs": [{"name": "C", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": 24}}],
        "parameters": {},
    }
    np.testing.assert_array_equal(np.frombuffer(data, "<f4").reshape(2, 3), c)


def test_the_binary_answer_is_a_view_of_a_contiguous_product() -> None:
    """C's bytes go out as they lie in the slab: no copy of a 64 MiB answer."""
    c = np.arange(6, dtype=np.float32).reshape(2, 3)
    _, data = encode_infer(c, "m", None, True, {})
    assert data is not None and np.shares_memory(np.frombuffer(data, np.uint8), c)


def test_encode_binary_of_an_empty_product() -> None:
    header, data = encode_infer(np.zeros((0, 3), np.float32), "m", None, True, {})
    assert data is not None and data.nbytes == 0 and orjson.loads(header)["outputs"][0]["shape"] == [0, 3]


def test_a_header_of_one_byte_is_read_as_one() -> None:
    """The smallest header length is 1: that byte is read as the JSON header (and is not an object)."""
    assert refusal(b"1" + doc(), "1") == ("malformed_payload", "the inference request must be a JSON object", None)


def test_false_is_a_boolean_too() -> None:
    """A header holding 'false' and no 'true' still gets the exact check: np.array would read false as 0."""
    assert refusal(doc({**A, "data": [1, 2, 3, 4, 5, False]}, B)) == (
        "invalid_matrix",
        "input 'A' data holds booleans, expected numbers",
        ["A"],
    )


# ------------------------------------------------------------------------------------ shared-memory tensors


def in_region(tensor: dict[str, Any], **parameters: Any) -> dict[str, Any]:
    placed = {key: value for key, value in tensor.items() if key != "data"}
    return {**placed, "parameters": parameters}


def test_inputs_and_the_output_in_shared_memory() -> None:
    a = in_region(A, shared_memory_region="r", shared_memory_byte_size=24, shared_memory_offset=8)
    b = in_region({**B, "datatype": "FP64"}, shared_memory_region="s", shared_memory_byte_size=24)
    outputs = [{"name": "C", "parameters": {"shared_memory_region": "t", "shared_memory_byte_size": 100}}]
    request = decode_infer(doc(a, b, outputs=outputs), None, LIMITS)
    assert request.operands.a == SharedTensor("r", 8, (2, 3), np.dtype("<f4"))
    assert request.operands.b == SharedTensor("s", 0, (3, 1), np.dtype("<f8"))
    assert request.operands.options.dtype == "float64"
    assert request.output_region == SharedOutput("t", 0, 100)
    assert decode_infer(doc(), None, LIMITS).output_region is None


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ({"shared_memory_region": "r", "shared_memory_byte_size": 20}, "its shared_memory_byte_size is 20"),
        ({"shared_memory_region": "r"}, "needs both shared_memory_region and shared_memory_byte_size, or neither"),
        ({"shared_memory_byte_size": 24}, "needs both shared_memory_region and shared_memory_byte_size, or neither"),
        ({"shared_memory_offset": 0}, "has a shared_memory_offset but no shared_memory_region"),
        ({"shared_memory_region": "", "shared_memory_byte_size": 24}, "shared_memory_region must be a region's name"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": True}, "shared_memory_byte_size must be a byte"),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 24, "shared_memory_offset": -8},
            "shared_memory_offset must be a byte count, got -8",
        ),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 24, "binary_data_size": 24},
            "must carry neither data nor binary_data_size",
        ),
    ],
)
def test_shared_memory_parameters_are_checked(parameters: dict[str, Any], problem: str) -> None:
    code, message, location = refusal(doc(in_region(A, **parameters), B))
    assert code == "shared_memory" and problem in message and message.startswith("input 'A'")
    assert location == ["A"]


def test_an_input_in_shared_memory_with_data_too_is_refused() -> None:
    a = {**A, "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 24}}
    assert refusal(doc(a, B)) == (
        "shared_memory",
        "input 'A' is in shared memory and must carry neither data nor binary_data_size",
        ["A"],
    )


@pytest.mark.parametrize(
    ("a_offset", "c_offset", "overlap"),
    [(0, 0, True), (0, 23, True), (8, 0, True), (0, 24, False), (16, 0, False), (40, 0, False)],
)
def test_an_output_window_over_an_input_in_its_region_is_refused(a_offset: int, c_offset: int, overlap: bool) -> None:
    """A (2x3 FP32, 24 bytes) at `a_offset` of region r, C's 16-byte window at `c_offset`: refused when they share a
    byte, whichever lies first; B in region s, and windows that only touch, are apart."""
    a = in_region(A, shared_memory_region="r", shared_memory_byte_size=24, shared_memory_offset=a_offset)
    b = in_region(B, shared_memory_region="s", shared_memory_byte_size=12)
    window = {"shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": c_offset}
    body = doc(a, b, outputs=[{"name": "C", "parameters": window}])
    if not overlap:
        assert decode_infer(body, None, LIMITS).output_region == SharedOutput("r", c_offset, 16)
        return
    assert refusal(body) == (
        "shared_memory",
        f"output 'C' at bytes {c_offset} to {c_offset + 16} of region 'r' overlaps input 'A' at bytes {a_offset} to "
        f"{a_offset + 24}: the product would overwrite an operand it reads; place C apart from its inputs",
        ["outputs", 0],
    )


def test_an_empty_output_window_overlaps_nothing() -> None:
    """An empty stack's C has no bytes: its window of 0 at an input's offset writes none of it."""
    a = in_region(A, shared_memory_region="r", shared_memory_byte_size=24)
    window = {"shared_memory_region": "r", "shared_memory_byte_size": 0, "shared_memory_offset": 8}
    request = decode_infer(doc(a, B, outputs=[{"name": "C", "parameters": window}]), None, LIMITS)
    assert request.output_region == SharedOutput("r", 8, 0)


def test_the_output_region_is_checked() -> None:
    outputs = [{"name": "C", "parameters": {"shared_memory_region": "t"}}]
    assert refusal(doc(outputs=outputs)) == (
        "shared_memory",
        "output 'C' needs both shared_memory_region and shared_memory_byte_size, or neither",
        ["outputs", 0],
    )


def test_an_answer_for_an_output_in_shared_memory_says_where_it_is() -> None:
    body = encode_infer_in_region(
        (2, 1), np.dtype(np.float64), SharedOutput("t", 16, 100), "matmul", "7", {"kernel": "numpy"}
    )
    assert orjson.loads(body) == {
        "model_name": "matmul",
        "model_version": "1",
        "id": "7",
        "parameters": {"kernel": "numpy"},
        "outputs": [
            {
                "name": "C",
                "datatype": "FP64",
                "shape": [2, 1],
                "parameters": {
                    "shared_memory_region": "t",
                    "shared_memory_offset": 16,
                    "shared_memory_byte_size": 16,
                },
            }
        ],
    }
