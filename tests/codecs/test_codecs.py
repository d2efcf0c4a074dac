"""The codecs alone: what each decoder accepts, what it refuses and how it says so; the encoders."""

from __future__ import annotations

import io
import re
import tracemalloc
import warnings
import zipfile
from collections.abc import Callable

import numpy as np
import orjson
import pytest

from app import codecs, service
from app.api.negotiation import choose_encoding
from app.errors import InvalidMatrix, InvalidParameter, MalformedPayload, NotAcceptable, ShapeMismatch
from matmul_tools.bodies import load_npy, npy_bytes, npz_bytes, zip_members

LIMITS = codecs.Limits(max_dim=1000, max_elements=10_000, max_result_elements=100_000)


def json_body(**doc: object) -> bytes:
    return orjson.dumps(doc)


class TestJson:
    def test_matrices_and_options(self) -> None:
        ops = codecs.json.decode_json(
            json_body(a=[[1, 2]], b=[[3.5], [4]], kernel="tiled", tile=8, dtype="float64"), LIMITS
        )
        assert ops.a.tolist() == [[1, 2]] and ops.b.tolist() == [[3.5], [4]]
        assert ops.options == codecs.RequestOptions(kernel="tiled", tile=8, dtype="float64")

    def test_zero_columns_are_a_matrix(self) -> None:
        ops = codecs.json.decode_json(json_body(a=[[], []], b=[[1]]), LIMITS)
        assert ops.a.shape == (2, 0)

    @pytest.mark.parametrize(
        ("body", "error", "location", "words"),
        [
            (b"", MalformedPayload, None, "empty"),
            (b"{", MalformedPayload, None, "not valid JSON"),
            (b"[1, 2]", MalformedPayload, None, "must be an object"),
            (json_body(b=[[1]]), InvalidMatrix, ["a"], "no matrix 'a'"),
            (json_body(a=[[1]]), InvalidMatrix, ["b"], "no matrix 'b'"),
            (json_body(a=[], b=[[1]]), InvalidMatrix, ["a"], "with no rows"),
            (json_body(a=5, b=[[1]]), InvalidMatrix, ["a"], "a number"),
            (json_body(a=[1, 2], b=[[1]]), InvalidMatrix, ["a", 0], "must be a list of rows"),
            (json_body(a=[[1, 2], [3]], b=[[1]]), InvalidMatrix, ["a", 1], "ragged: row 1 has 1 elements"),
            (json_body(a=[[1]], b=[[1, "x"]]), InvalidMatrix, ["b", 0, 1], "b[0][1] is a string"),
            (json_body(a=[[1, True]], b=[[1]]), InvalidMatrix, ["a", 0, 1], "a[0][1] is a boolean"),
            (json_body(a=[[None]], b=[[1]]), InvalidMatrix, ["a", 0, 0], "is null"),
            (json_body(a=[[{"x": 1}]], b=[[1]]), InvalidMatrix, ["a", 0, 0], "is an object"),
            (json_body(a=[[[[1]]]], b=[[1]]), InvalidMatrix, ["a"], "got 4-D with shape [1, 1, 1, 1]"),
            (
                json_body(a=[[[1]], [[1, 2]]], b=[[1]]),
                InvalidMatrix,
                ["a", 1],
                "the stack 'a' is ragged: matrix 1 is 1x2",
            ),
            (json_body(a=[[1]], b=[[1]], c=1), InvalidParameter, ["c"], "unknown keys"),
            (json_body(a=[[1]], b=[[1]], tile="8"), InvalidParameter, ["tile"], "must be an integer"),
            (json_body(a=[[1]], b=[[1]], tile=True), InvalidParameter, ["tile"], "must be an integer"),
            (json_body(a=[[1]], b=[[1]], kernel=3), InvalidParameter, ["kernel"], "must be a string"),
            (b'{"a": [[NaN]], "b": [[1]]}', MalformedPayload, None, "not valid JSON"),
            (b'{"a": [[1e400]], "b": [[1]]}', MalformedPayload, None, "not valid JSON"),
            (b'{"a": [[Infinity]], "b": [[1]]}', MalformedPayload, None, "not valid JSON"),
            (b'{"a": [[-Infinity]], "b": [[1]]}', MalformedPayload, None, "not valid JSON"),
            (json_body(a=[[0] * 1001], b=[[1]]), ShapeMismatch, ["a"], "over the limit of 1000"),
        ],
    )
    def test_refusals_say_what_and_where(
        self, body: bytes, error: type[Exception], location: list[object] | None, words: str
    ) -> None:
        with pytest.raises(error) as caught:
            codecs.json.decode_json(body, LIMITS)
        assert words in str(caught.value)
        assert getattr(caught.value, "location", None) == location

    def test_a_matrix_over_the_limits_is_refused_before_numpy_builds_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def never(*args: object, **kwargs: object) -> np.ndarray:
            raise AssertionError("np.array was called on a matrix over the limits")

        monkeypatch.setattr(codecs.np, "array", never)
        with pytest.raises(ShapeMismatch, match="dimension 1 of 'a' is 1001"):
            codecs.json.decode_json(json_body(a=[[0] * 1001, [0]], b=[[1]]), LIMITS)

    def test_true_inside_a_string_option_does_not_reject_numbers(self) -> None:
        ops = codecs.json.decode_json(json_body(a=[[1]], b=[[2]], kernel="true"), LIMITS)
        assert ops.a.tolist() == [[1]]


class TestNpy:
    @pytest.mark.parametrize("dtype", ["<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<i8", "u1", "<i2"])
    @pytest.mark.parametrize("order", ["C", "F"])
    def test_any_byte_order_and_layout_round_trips(self, dtype: str, order: str) -> None:
        array = np.asarray(np.arange(12).reshape(3, 4), dtype=dtype, order=order)
        decoded = codecs.npy.decode_npy(npy_bytes(array), "a", LIMITS)
        assert decoded.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(decoded, array)

    def test_decoding_does_not_copy(self) -> None:
        body = npy_bytes(np.ones((64, 64), np.float32))
        assert not codecs.npy.decode_npy(body, "a", LIMITS).flags.owndata

    @pytest.mark.parametrize(
        ("array", "words"),
        [
            (np.ones(3), r"or 3-D \(a stack of matrices, one leading batch dimension\), got 1-D"),
            (np.ones((2, 1, 2, 2)), r"or 3-D \(a stack of matrices, one leading batch dimension\), got 4-D"),
            (np.array(1.0), r"or 3-D \(a stack of matrices, one leading batch dimension\), got 0-D"),
            (np.ones((2, 2), np.complex64), "dtype complex64"),
            (np.ones((2, 2), np.bool_), "dtype bool"),
            (np.array([["ab"]]), "dtype <U2"),
            (np.zeros((2, 2), dtype=[("x", "<f4")]), "supported are float16, float32"),
            (np.ones((2, 2000)), "over the limit of 1000"),
        ],
    )
    def test_refuses_what_is_not_a_numeric_matrix(self, array: np.ndarray, words: str) -> None:
        with pytest.raises((InvalidMatrix, ShapeMismatch), match=words):
            codecs.npy.decode_npy(npy_bytes(array), "a", LIMITS)

    def test_refuses_pickled_objects_without_unpickling(self) -> None:
        buffer = io.BytesIO()
        np.save(buffer, np.array([[object()]], dtype=object), allow_pickle=True)
        with pytest.raises(InvalidMatrix, match="pickled Python objects"):
            codecs.npy.decode_npy(buffer.getvalue(), "b", LIMITS)

    @pytest.mark.parametrize("cut", [1, 4, 63])
    def test_truncated_data_is_malformed(self, cut: int) -> None:
        body = npy_bytes(np.ones((4, 4), np.float32))
        with pytest.raises(MalformedPayload, match="truncated"):
            codecs.npy.decode_npy(body[:-cut], "a", LIMITS)

    def test_trailing_bytes_are_malformed(self) -> None:
        with pytest.raises(MalformedPayload, match="68 bytes follow"):
            codecs.npy.decode_npy(npy_bytes(np.ones((4, 4), np.float32)) + b"junk", "a", LIMITS)

    @pytest.mark.parametrize("body", [b"", b"not an npy file at all", b"\x93NUMPY\x01\x00\xff\xff{'descr"])
    def test_garbage_is_malformed(self, body: bytes) -> None:
        with pytest.raises(MalformedPayload, match=r"'a' is not a valid \.npy"):
            codecs.npy.decode_npy(body, "a", LIMITS)

    @pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
    def test_every_format_version_numpy_writes_is_read(self, version: tuple[int, int]) -> None:
        """3.0 is 2.0 with a UTF-8 header (NumPy writes it for field names that are not latin-1)."""
        buffer = io.BytesIO()
        np.lib.format.write_array(buffer, np.arange(6, dtype=">i2").reshape(2, 3), version=version)
        np.testing.assert_array_equal(codecs.npy.decode_npy(buffer.getvalue(), "a", LIMITS), np.arange(6).reshape(2, 3))

    @pytest.mark.parametrize(
        ("header", "words"),
        [
            ("'shape': (True, 4)", "'True' in the shape, where only non-negative integers go"),
            ("'shape': (" + "-" * 5000 + "2, 2)", "something NumPy does not write at character 51 ('-----"),
            ("'shape': (" + "+" * 5000 + "2, 2)", "something NumPy does not write"),
            ("'shape': (" + "9" * 5000 + ", 2)", "something NumPy does not write"),
            ("'shape': ((2, 2), 2)", "'(' in the shape"),
            ("'shape': (2)", "a one-dimensional shape without its comma"),
            ("'shape': (2, 2), 'extra': 1", "the key 'extra'"),
            ("'shape': (2, 2), 'shape': (2, 2)", "the key 'shape'"),
            ("'shape': [2, 2]", "'[' as its 'shape'"),
            ("'shape': (2, 2)} + {", "text after the closing '}'"),
            ("'shape': (2L, 2)", "something NumPy does not write"),
        ],
    )
    def test_a_header_numpy_would_not_write_is_refused_before_evaluation(self, header: str, words: str) -> None:
        text = "{'descr': '<f4', 'fortran_order': False, " + header + "}"
        text += " " * (-(len(text) + 11) % 64) + "\n"
        body = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode() + bytes(16)
        with pytest.raises(MalformedPayload, match=re.escape(words)) as refused:
            codecs.npy.decode_npy(body, "a", LIMITS)
        assert refused.value.location == ["a"]

    def test_a_version_1_header_must_be_ascii(self) -> None:
        body = npy_bytes(np.eye(2, dtype=np.float32)).replace(b"'<f4'", b"'\xe9f4'")
        with pytest.raises(MalformedPayload, match=r"version 1\.0 header is not ASCII \(format 3\.0 is for UTF-8"):
            codecs.npy.decode_npy(body, "a", LIMITS)

    @pytest.mark.parametrize("version", [b"\x04\x00", b"\x01\x01", b"\x00\x00"])
    def test_format_versions_numpy_does_not_write_are_refused(self, version: bytes) -> None:
        body = npy_bytes(np.eye(2))
        with pytest.raises(MalformedPayload, match=r"NumPy writes 1\.0, 2\.0 and 3\.0"):
            codecs.npy.decode_npy(body[:6] + version + body[8:], "a", LIMITS)

    def test_a_header_claiming_a_huge_shape_is_refused_before_allocating(self) -> None:
        body = npy_bytes(np.ones((2, 2), np.float32)).replace(b"(2, 2)", b"(900, 900)")
        with pytest.raises(ShapeMismatch, match="810000 elements"):
            codecs.npy.decode_npy(body, "a", LIMITS)


class TestParts:
    def test_npz(self) -> None:
        a, b = np.ones((2, 3)), np.ones((3, 4), np.float32)
        ops = codecs.npz.decode_npz(npz_bytes(a=a, b=b), LIMITS, max_member_bytes=1 << 20)
        np.testing.assert_array_equal(ops.a, a)
        np.testing.assert_array_equal(ops.b, b)

    def test_compressed_npz(self) -> None:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, a=np.eye(3), b=np.eye(3))
        ops = codecs.npz.decode_npz(buffer.getvalue(), LIMITS, max_member_bytes=1 << 20)
        np.testing.assert_array_equal(ops.a, np.eye(3))

    @pytest.mark.parametrize(
        ("members", "words"),
        [({"a": np.eye(2)}, "missing ['b']"), ({"a": np.eye(2), "b": np.eye(2), "c": np.eye(2)}, "unexpected ['c']")],
    )
    def test_npz_members_must_be_exactly_a_and_b(self, members: dict[str, np.ndarray], words: str) -> None:
        with pytest.raises(InvalidMatrix, match=words.replace("[", r"\[").replace("]", r"\]")):
            codecs.npz.decode_npz(npz_bytes(**members), LIMITS, max_member_bytes=1 << 20)

    @pytest.mark.parametrize(("first", "second"), [("a.npy", "a.npy"), ("a", "a.npy"), ("b.npy", "b")])
    def test_an_npz_member_held_twice_is_refused(self, first: str, second: str) -> None:
        """Both copies are refused rather than the last one multiplied, as a multipart part sent twice is."""
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate name it writes
            archive.writestr("a.npy" if first.startswith("b") else "b.npy", npy_bytes(np.eye(2)))
            archive.writestr(first, npy_bytes(np.ones((2, 2))))
            archive.writestr(second, npy_bytes(np.full((2, 2), 7.0)))
        member = first.removesuffix(".npy")
        words = f"the .npz archive holds '{member}' twice (members '{first}' and '{second}')"
        with pytest.raises(InvalidMatrix) as refused:
            codecs.npz.decode_npz(buffer.getvalue(), LIMITS, max_member_bytes=1 << 20)
        assert (refused.value.message, refused.value.location) == (words, [member])

    def test_npz_that_is_not_a_zip(self) -> None:
        with pytest.raises(MalformedPayload, match=r"not a valid \.npz"):
            codecs.npz.decode_npz(b"PK\x03\x04 nonsense", LIMITS, max_member_bytes=1 << 20)

    def test_npz_member_over_the_limit_is_not_unpacked(self) -> None:
        body = npz_bytes(a=np.ones((64, 64)), b=np.eye(2))
        size = len(npy_bytes(np.ones((64, 64))))
        assert codecs.npz.decode_npz(body, LIMITS, max_member_bytes=size).a.shape == (64, 64)
        words = f"member 'a.npy' of the .npz unpacks to {size} bytes, over the limit of {size - 1}"
        with pytest.raises(InvalidMatrix, match=re.escape(words)):
            codecs.npz.decode_npz(body, LIMITS, max_member_bytes=size - 1)

    @staticmethod
    def _deflated_npz(a_member: bytes) -> bytes:
        return zip_members(compressed=True, a=a_member, b=npy_bytes(np.eye(2)))

    @staticmethod
    def _peak_bytes_of(decode: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            decode()
        except (ShapeMismatch, MalformedPayload):
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        return peak

    def test_a_compressed_header_claiming_a_huge_matrix_is_refused_before_it_is_inflated(self) -> None:
        """A body of kilobytes that would inflate to 64 MiB: the header is read first and refused."""
        header = npy_bytes(np.ones((2, 2), np.float32))[:-16].replace(b"(2, 2)", b"(1048576, 1048576)")
        body = self._deflated_npz(header + bytes(64 << 20))
        assert len(body) < 1 << 20
        with pytest.raises(ShapeMismatch, match="dimension 0 of 'a' is 1048576, over the limit"):
            codecs.npz.decode_npz(body, LIMITS, max_member_bytes=1 << 30)
        peak = self._peak_bytes_of(lambda: codecs.npz.decode_npz(body, LIMITS, max_member_bytes=1 << 30))
        assert peak < 4 << 20

    def test_a_member_larger_than_its_header_says_is_refused_before_it_is_inflated(self) -> None:
        body = self._deflated_npz(npy_bytes(np.eye(2)) + bytes(64 << 20))
        with pytest.raises(MalformedPayload, match=r"'a' is a 2x2 float64 \.npy whose data should be 32 bytes, but"):
            codecs.npz.decode_npz(body, LIMITS, max_member_bytes=1 << 30)
        peak = self._peak_bytes_of(lambda: codecs.npz.decode_npz(body, LIMITS, max_member_bytes=1 << 30))
        assert peak < 4 << 20

    def test_npz_member_that_is_not_npy(self) -> None:
        body = zip_members(a=b"hello", b=npy_bytes(np.eye(2)))
        with pytest.raises(MalformedPayload, match=r"'a' is not a valid \.npy"):
            codecs.npz.decode_npz(body, LIMITS, max_member_bytes=1 << 20)


class TestChecks:
    def test_inner_dimensions(self) -> None:
        with pytest.raises(ShapeMismatch, match=r"'a' is 2x3 and 'b' is 4x5"):
            service.check_product(np.ones((2, 3)), np.ones((4, 5)), LIMITS)

    def test_result_limit(self) -> None:
        service.check_product(np.ones((300, 1)), np.ones((1, 300)), LIMITS)
        with pytest.raises(ShapeMismatch, match="'result' has 160000 elements, over the limit of 100000"):
            service.check_product(np.ones((400, 1)), np.ones((1, 400)), LIMITS)

    @pytest.mark.parametrize(
        ("requested", "a", "b", "expected"),
        [
            (None, "f4", "f4", "float32"),
            (None, "i8", "i4", "float32"),
            (None, "f4", ">f8", "float64"),
            ("float32", "f8", "f8", "float32"),
            ("float64", "i8", "f4", "float64"),
        ],
    )
    def test_working_dtype(self, requested: str | None, a: str, b: str, expected: str) -> None:
        dtype = service.working_dtype(requested, None, codecs.Operands(np.ones((1, 1), a), np.ones((1, 1), b)))
        assert dtype == np.dtype(expected)

    def test_json_numbers_default_to_float32(self) -> None:
        ops = codecs.json.decode_json(json_body(a=[[0.5]], b=[[1.5]]), LIMITS)
        assert service.working_dtype(None, None, ops) == np.float32

    def test_unknown_dtype(self) -> None:
        with pytest.raises(InvalidParameter, match="'float16' is not supported"):
            service.working_dtype("float16", None, codecs.Operands(np.ones((1, 1)), np.ones((1, 1))))

    def test_options_given_twice_must_agree(self) -> None:
        query = codecs.RequestOptions(kernel="tiled", tile=None)
        assert query.merged_with(codecs.RequestOptions(tile=8)) == codecs.RequestOptions(kernel="tiled", tile=8)
        with pytest.raises(InvalidParameter, match="'kernel' is given twice"):
            query.merged_with(codecs.RequestOptions(kernel="naive"))


class TestEncoding:
    @pytest.mark.parametrize(
        ("accept", "expected"),
        [
            (None, "application/json"),
            ("*/*", "application/json"),
            ("application/x-npy", "application/x-npy"),
            ("application/json;q=0.5, application/x-npy", "application/x-npy"),
            ("application/x-npy;q=0, application/json", "application/json"),
            ("text/html, application/*;q=0.1", "application/json"),
        ],
    )
    def test_accept(self, accept: str | None, expected: str) -> None:
        assert choose_encoding(accept) == expected

    def test_unacceptable(self) -> None:
        with pytest.raises(NotAcceptable, match="text/csv"):
            choose_encoding("text/csv")

    @pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)])
    def test_npy_of_an_empty_product(self, shape: tuple[int, int]) -> None:
        decoded = load_npy(codecs.npy.encode_npy(np.zeros(shape, np.float32)))
        assert decoded.shape == shape and decoded.dtype == np.float32

    def test_npy_of_a_fortran_ordered_array_keeps_its_values(self) -> None:
        array = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
        np.testing.assert_array_equal(load_npy(codecs.npy.encode_npy(array)), array)

    def test_npy_round_trip(self) -> None:
        array = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
        np.testing.assert_array_equal(load_npy(codecs.npy.encode_npy(array)), array)

    def test_json_envelope(self) -> None:
        matrix = codecs.json.encode_json_matrix(np.array([[1.5, np.nan]], np.float32))
        doc = orjson.loads(codecs.json.encode_json_envelope(matrix, {"shape": [1, 2]}))
        assert doc == {"result": [[1.5, None]], "shape": [1, 2]}
