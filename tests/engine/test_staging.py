"""Staging operands into the working dtype: in one pass, or in bands of rows on several threads."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from app.engine.staging import PARALLEL_BYTES, cast_into, cast_into_parallel, check_in_format
from app.errors import InvalidMatrix
from numerics.precision import FLOAT_PRECISIONS, Precision, to_bf16, to_fp16, to_tf32

ROWS = 1024
COLUMNS = PARALLEL_BYTES // (4 * ROWS)
"""A float32 operand exactly at the size that is split into bands."""


@pytest.fixture(scope="module")
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


@pytest.mark.parametrize("rows", [ROWS, ROWS - 1, 3])
def test_bands_of_rows_copy_every_element_converted(threads: ThreadPoolExecutor, rows: int) -> None:
    src = np.asfortranarray(np.random.default_rng(0).standard_normal((rows, COLUMNS)).astype(">f8"))
    dst = np.full((rows, COLUMNS), np.nan, np.float32)
    cast_into_parallel(dst, src, "a", threads, bands=4)
    np.testing.assert_array_equal(dst, src.astype(np.float32))


def test_a_value_out_of_range_in_a_later_band_names_its_row_in_the_whole_matrix(threads: ThreadPoolExecutor) -> None:
    src = np.zeros((ROWS, COLUMNS))
    src[900, 7] = 1e39
    src[1000, 1] = -1e39
    with pytest.raises(InvalidMatrix, match=r"b\[900\]\[7\] = 1e\+39 is out of range for float32") as caught:
        cast_into_parallel(np.empty((ROWS, COLUMNS), np.float32), src, "b", threads, bands=4)
    assert caught.value.location == ["b", 900, 7]


class HeldBands(ThreadPoolExecutor):
    """Copies the first band of rows at once and every later one only once `release` is set."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(4)
        self.release = release

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def band(first_row: int) -> Any:
            if first_row:
                self.release.wait(GUARD_S)
            return fn(*args, first_row, **kwargs)

        *args, first_row = args
        return super().submit(band, first_row)


GUARD_S = 10


@pytest.mark.usefixtures("without_garbage_collection")
def test_a_refused_band_is_raised_once_every_band_has_ended_holding_no_operand() -> None:
    """The first band refuses a value while the others still copy: the refusal waits for them (the caller gives dst
    and src back once it returns), and nothing but the refusal itself holds them after."""
    src = np.zeros((ROWS, COLUMNS))
    src[5, 7] = 1e39
    dst = np.empty((ROWS, COLUMNS), np.float32)
    held = weakref.ref(src), weakref.ref(dst)
    refused: list[InvalidMatrix] = []

    def stage(dst: np.ndarray, src: np.ndarray, pool: HeldBands, refused: list[InvalidMatrix]) -> None:
        try:
            cast_into_parallel(dst, src, "a", pool, bands=4)
        except InvalidMatrix as exc:
            refused.append(exc)

    release = threading.Event()
    with HeldBands(release) as pool:
        staging = threading.Thread(target=stage, args=(dst, src, pool, refused))
        staging.start()
        staging.join(0.2)
        assert staging.is_alive()  # the first band has refused; three still copy
        release.set()
        staging.join(GUARD_S)
    assert refused[0].location == ["a", 5, 7]
    refused.clear()  # the refusal's traceback holds the frame of `stage`, which holds this list
    del src, dst
    assert all(ref() is None for ref in held)


def _just_below(limit: float) -> np.float32:
    """The largest float32 under `limit`."""
    below = np.float32(limit)
    return below if float(below) < limit else np.nextafter(below, np.float32(0))


@pytest.mark.parametrize(
    ("precision", "limit"),
    [
        (Precision.FP16, 65520.0),  # halfway from 65504 to 2^16
        (Precision.BF16, (2 - 2**-8) * 2.0**127),
        (Precision.TF32, (2 - 2**-11) * 2.0**127),
        (Precision.TF32X3, (2 - 2**-11) * 2.0**127),  # its big part is a TF32 rounding
    ],
)
def test_an_operand_is_refused_exactly_where_the_precisions_rounding_makes_it_infinite(
    precision: Precision, limit: float
) -> None:
    """The limits are each format's, from its fraction bits and largest exponent: the largest float32 under one
    rounds to a finite value there and passes; the limit itself (a float32 in every case) rounds to infinity."""
    rounding = {Precision.FP16: to_fp16, Precision.BF16: to_bf16}.get(precision, to_tf32)
    fits, overflows = _just_below(limit), np.float32(limit)
    assert float(overflows) == limit
    with np.errstate(over="ignore"):  # NumPy warns where a float16 conversion overflows: that is the point
        assert np.isfinite(rounding(np.array([fits, -fits]))).all() and np.isinf(rounding(np.array([overflows]))).all()
    src = np.zeros((3, 4), np.float32)
    src[2, 1] = fits
    src[0, 3] = -fits
    check_in_format(src, "a", precision)
    src[1, 2] = -overflows
    with pytest.raises(InvalidMatrix, match=rf"a\[6\]\[2\] = .* is out of range for precision {precision}") as caught:
        check_in_format(src, "a", precision, first_row=5)
    assert caught.value.location == ["a", 6, 2]


def test_nan_and_infinities_already_there_pass_and_fp32_checks_nothing() -> None:
    src = np.array([[np.nan, np.inf, -np.inf, 1.0]], np.float32)
    for precision in FLOAT_PRECISIONS:
        if precision is not Precision.FP8:
            check_in_format(src, "b", precision)
    check_in_format(np.full((2, 2), 1e38, np.float32), "b", Precision.FP32)
    with pytest.raises(InvalidMatrix, match=r"b\[0\]\[3\] = 70000.0 is out of range for precision fp16"):
        check_in_format(np.array([[np.nan, np.inf, 5.0, 7e4]], np.float32), "b", Precision.FP16)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_fp8_refuses_the_first_element_that_is_not_finite_and_takes_any_finite_one(bad: float) -> None:
    finite = np.array([[3.4e38, -3.4e38], [1e-45, 0.0], [448.0, 449.0]], np.float32)
    check_in_format(finite, "a", Precision.FP8)  # every finite value: the scale brings it into range
    src = finite.copy()
    src[2, 1], src[1, 0] = bad, bad
    with pytest.raises(InvalidMatrix, match=r"b\[4\]\[0\] = (nan|inf|-inf) is not finite: precision fp8") as caught:
        check_in_format(src, "b", Precision.FP8, first_row=3)
    assert caught.value.location == ["b", 4, 0]


@pytest.mark.parametrize(
    ("src", "words"),
    [
        (np.array([[1, 2], [3, 128]], np.int64), r"a\[1\]\[1\] = 128 is not an int8 \(an integer from -128 to 127\)"),
        (np.array([[1, -129], [3, 4]], ">i2"), r"a\[0\]\[1\] = -129 is not an int8"),
        (np.array([[1, 2], [255, 4]], np.uint8), r"a\[1\]\[0\] = 255 is not an int8"),
        (np.array([[1.0, 2.0], [3.0, 0.5]], np.float32), r"a\[1\]\[1\] = 0.5 is not an int8"),
        (np.array([[1.0, np.nan], [3.0, 4.0]]), r"a\[0\]\[1\] = nan is not an int8"),
        (np.array([[np.inf, 1.0], [3.0, 4.0]]), r"a\[0\]\[0\] = inf is not an int8"),
    ],
)
def test_int8_operands_take_integers_in_int8s_range_alone(src: np.ndarray, words: str) -> None:
    """Staged for an int32 product, a value that is not an int8 is refused where it is, never wrapped or truncated,
    whether it comes as a wider integer, an unsigned one or a float; the whole-number floats in range pass as their
    integers, and so does every int8."""
    dst = np.empty((2, 2), np.int8)
    with pytest.raises(InvalidMatrix, match=words) as caught:
        cast_into(dst, src, "a")
    assert caught.value.location == ["a", *np.argwhere(src != np.clip(np.round(src), -128, 127))[0].tolist()]
    with pytest.raises(InvalidMatrix, match=words):
        check_in_format(src, "a", Precision.INT8)
    cast_into(dst, np.array([[-128.0, 127.0], [0.0, -0.0]]), "a")
    assert dst.tolist() == [[-128, 127], [0, 0]]
    check_in_format(np.array([[-128, 127]], np.int8), "a", Precision.INT8)


def test_staging_in_a_precision_refuses_what_its_rounding_makes_infinite() -> None:
    dst = np.empty((1, 2), np.float32)
    with pytest.raises(InvalidMatrix, match=r"a\[0\]\[1\] = 70000.0 is out of range for precision fp16"):
        cast_into(dst, np.array([[1, 70000]], np.int32), "a", precision=Precision.FP16)
    cast_into(dst, np.array([[1, 70000]], np.int32), "a", precision=Precision.BF16)
    cast_into(dst, np.array([[np.finfo(np.float16).max] * 2], np.float16), "a", precision=Precision.FP16)


@pytest.mark.gpu
def test_a_device_operand_is_checked_on_the_device() -> None:
    """CUDA shared memory: the client's operand never leaves the device to be checked."""
    import cupy

    operand = cupy.zeros((64, 64), cupy.float32)
    check_in_format(operand, "b", Precision.FP16)
    operand[40, 3] = 1e5
    with pytest.raises(InvalidMatrix, match=r"b\[40\]\[3\] = 100000.0 is out of range for precision fp16"):
        check_in_format(operand, "b", Precision.FP16)
