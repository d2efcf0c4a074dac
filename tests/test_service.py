"""The service: its checks (inner dimensions, the result's limits, the working dtype) and their messages, what it
hands the engine (the options, the deadline capped at the request timeout), and its figures: each stage of the
stopwatch in milliseconds, GFLOP/s as the launch's 2*m*n*k / kernel time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from time import perf_counter

import numpy as np
import pytest

from app import service
from app.codecs import Limits, Operands, RequestOptions
from app.config import Settings
from app.engine import DeviceTiming, EngineState, Outcome, Plan, ProductRequest
from app.engine.device_worker import DeviceWorker
from app.errors import InvalidParameter, ShapeMismatch
from app.product import RooflineModel
from app.shapes import ProductShape
from kernels.registry import KERNELS
from numerics.precision import Precision
from numerics.roofline import DevicePeaks
from tests.fakes import RecordingEngine, SteeredBackend, until

ROOFLINE = RooflineModel(
    flops=0, global_bytes=0, intensity=None, peak_gflops=None, peak_fraction=None, global_gbps=None, dram_gbps=None
)


def _product(m: int, k: int, n: int, kernel_ms: float, batch_size: int = 1) -> service.Product:
    outcome = Outcome(
        c=np.zeros((m, n)),
        plan=Plan(kernel="numpy"),
        queue_ms=3.0,
        device=DeviceTiming(h2d_ms=0.5, kernel_ms=kernel_ms, d2h_ms=0.25),
        device_name="test",
        peaks=DevicePeaks(),
        global_elements=m * k + k * n + m * n,
        batch_size=batch_size,
        stage_ms=0.125,
        handoff_ms=0.0625,
    )
    clock = service.Stopwatch(received=100.0, read=100.5, decoded=101.25, computed=102.0)
    return service.Product(outcome, np.dtype(np.float32), ProductShape(m, k, n), "cpu", clock, ROOFLINE)


def test_each_stage_is_reported_in_milliseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Received at 100 s, read at 100.5 s, decoded at 101.25 s, computed at 102 s, described at 104 s."""
    monkeypatch.setattr(service, "perf_counter", lambda: 104.0)
    timing = _product(2, 3, 4, kernel_ms=1.5).describe().timing
    assert timing.model_dump() == {
        "read_ms": 500.0, "decode_ms": 750.0, "stage_ms": 0.125, "handoff_ms": 0.0625, "queue_ms": 3.0,
        "h2d_ms": 0.5, "kernel_ms": 1.5, "d2h_ms": 0.25,
        "encode_ms": 2000.0, "total_ms": 4000.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "kernel_ms", "batch_size", "gflops"),
    [((1000, 2000, 3000), 4.0, 1, 3000.0), ((10, 20, 30), 0.5, 4, 0.096), ((0, 5, 5), 1.0, 1, None),
     ((5, 5, 5), 0.0, 1, None)],
)  # fmt: skip
def test_gflops_is_the_launchs_work_over_its_kernel_time(
    shape: tuple[int, int, int], kernel_ms: float, batch_size: int, gflops: float | None
) -> None:
    """2 * 1000 * 3000 * 2000 FLOPs in 4 ms are 3000 GFLOP/s; a batch of 4 does 4 times the work in its launch;
    no work, or no time measured, has no rate."""
    m, k, n = shape
    described = _product(m, k, n, kernel_ms, batch_size).describe()
    assert described.gflops == (None if gflops is None else pytest.approx(gflops, rel=1e-12))
    assert described.batch_size == batch_size and described.shape == (m, n)


# ------------------------------------------------------------------------------------------------ the checks

LIMITS = Limits(max_dim=8, max_elements=40, max_result_elements=12)


def test_inner_dimensions_that_differ_name_both_shapes() -> None:
    with pytest.raises(ShapeMismatch) as caught:
        service.check_product(np.ones((2, 3)), np.ones((4, 5)), LIMITS)
    assert caught.value.message == (
        "inner dimensions differ: 'a' is 2x3 and 'b' is 4x5; a's columns (3) must equal b's rows (4)"
    )
    assert caught.value.location == ["b", 0]


def test_the_result_is_held_to_its_own_limit() -> None:
    service.check_product(np.ones((3, 2)), np.ones((2, 4)), LIMITS)
    with pytest.raises(ShapeMismatch) as caught:
        service.check_product(np.ones((3, 2)), np.ones((2, 5)), LIMITS)
    assert caught.value.message == "matrix 'result' has 15 elements, over the limit of 12"
    with pytest.raises(ShapeMismatch, match=r"^dimension 1 of 'result' is 9, over the limit of 8$"):
        service.check_product(np.ones((1, 2)), np.ones((2, 9)), LIMITS)


@pytest.mark.parametrize(
    ("requested", "precision", "a", "b", "typed", "expected"),
    [
        ("float64", None, "float32", "float32", True, "float64"),
        ("float32", None, "float64", "float64", True, "float32"),
        (None, None, "float32", ">f8", True, "float64"),
        (None, None, "<f8", "int64", True, "float64"),
        (None, None, "float32", "int64", True, "float32"),
        (None, None, "float64", "float64", False, "float32"),
        (None, None, "int8", "int8", True, "int32"),  # an int8 pair: its exact product, never float
        (None, None, "int8", "int16", True, "float32"),
        (None, None, "int64", "int64", False, "float32"),  # JSON integers: float32 unless asked
        (None, "int8", "int64", "int64", False, "int32"),
        ("int32", None, "float64", "float64", False, "int32"),
        ("float32", None, "int8", "int8", True, "float32"),  # asked for in words: the float product
    ],
)
def test_working_dtype(
    requested: str | None, precision: str | None, a: str, b: str, typed: bool, expected: str
) -> None:
    operands = Operands(a=np.ones((1, 1), a), b=np.ones((1, 1), b), typed=typed)
    assert service.working_dtype(requested, precision, operands) == np.dtype(expected)


@pytest.mark.parametrize(
    ("requested", "a", "b", "working", "expected"),
    [
        (None, "float16", ">f2", "float32", Precision.FP16),
        (None, "float16", "float32", "float32", Precision.FP32),
        (None, "float16", "int8", "float32", Precision.FP32),
        (None, "float16", "float16", "float64", Precision.FP32),
        ("fp32", "float16", "float16", "float32", Precision.FP32),
        ("bf16", "float16", "float16", "float32", Precision.BF16),
        (None, "float32", "float32", "float32", Precision.FP32),
        (None, "int8", "int8", "int32", Precision.INT8),
        ("int8", "int8", "int8", "int32", Precision.INT8),
    ],
)
def test_two_float16_operands_default_to_their_natural_precision(
    requested: str | None, a: str, b: str, working: str, expected: Precision
) -> None:
    operands = Operands(a=np.ones((1, 1), a), b=np.ones((1, 1), b))
    assert service.requested_precision(requested, np.dtype(working), operands) is expected


def test_an_unsupported_dtype_names_the_choices() -> None:
    with pytest.raises(InvalidParameter) as caught:
        service.working_dtype("float16", None, Operands(a=np.ones((1, 1)), b=np.ones((1, 1))))
    assert caught.value.message == "dtype 'float16' is not supported; choose one of ['float32', 'float64', 'int32']"
    assert caught.value.location == ["dtype"]


def test_the_stopwatch_counts_milliseconds_since_the_request_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = service.Stopwatch(received=7.0)
    assert (clock.read, clock.decoded, clock.computed) == (0.0, 0.0, 0.0)
    monkeypatch.setattr(service, "perf_counter", lambda: 7.25)
    clock.mark_read()
    monkeypatch.setattr(service, "perf_counter", lambda: 7.5)
    clock.mark_decoded()
    monkeypatch.setattr(service, "perf_counter", lambda: 9.0)
    assert (clock.read, clock.decoded, clock.elapsed_ms()) == (7.25, 7.5, 2000.0)


# ------------------------------------------------------------------------------------------------ the run


@pytest.fixture
async def engine() -> AsyncIterator[RecordingEngine]:
    """An in-process engine over the CPU backend whose launches report 2 ms of kernel time."""
    recording = RecordingEngine(DeviceWorker(SteeredBackend(DeviceTiming(0.0, 2.0, 0.0)), queue_size=2))
    recording.start()
    await until(lambda: recording.state is EngineState.READY)
    yield recording
    await recording.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(("deadline_s", "queue_s"), [(None, 5.0), (2.0, 2.0), (5.0, 5.0), (9.0, 5.0)])
async def test_run_hands_the_engine_its_options_and_the_capped_deadline(
    engine: RecordingEngine, monkeypatch: pytest.MonkeyPatch, deadline_s: float | None, queue_s: float
) -> None:
    settings = Settings(backend="cpu", max_dim=8, max_elements=40, max_result_elements=12, request_timeout_s=5.0)
    matmul = service.MatmulService(engine, settings)
    assert matmul.limits == LIMITS and matmul.max_queue_s == 5.0
    a, b = np.arange(6.0).reshape(2, 3), np.ones((3, 4))
    clock = service.Stopwatch(received=1.0, read=1.0, decoded=1.0)
    monkeypatch.setattr(service, "perf_counter", lambda: 4.0)
    product = await matmul.run(Operands(a=a, b=b), RequestOptions(kernel="tiled", tile=8), deadline_s, clock)
    assert engine.calls == [(ProductRequest(2, 4, 3, "float64", "tiled", 8, Precision.FP32), queue_s)]
    assert (product.shape, product.dtype, product.backend) == (ProductShape(2, 3, 4), np.dtype(np.float64), "cpu")
    assert clock.computed == 4.0 and product.clock is clock
    np.testing.assert_array_equal(product.c, a @ b)
    # the product's work, and the traffic of `tiled` with 8x8 tiles (float64), moved in 2 ms
    global_bytes = KERNELS["tiled"].config_for(2, 4, 3, 8).global_elements(2, 4, 3) * 8
    assert (product.roofline.flops, product.roofline.global_bytes) == (2 * 2 * 3 * 4, global_bytes)
    assert product.roofline.global_gbps == pytest.approx(global_bytes / 2e-3 / 1e9, rel=1e-12)


@pytest.mark.anyio
async def test_run_asks_for_auto_when_no_kernel_is_named_and_checks_first(engine: RecordingEngine) -> None:
    matmul = service.MatmulService(engine, Settings(backend="cpu", max_result_elements=12))
    operands = Operands(a=np.ones((2, 3), np.float32), b=np.ones((3, 4), np.float32))
    await matmul.run(operands, RequestOptions(), None, service.Stopwatch())
    assert engine.calls[0][0] == ProductRequest(2, 4, 3, "float32", "auto", None, Precision.FP32)
    with pytest.raises(ShapeMismatch):
        await matmul.run(Operands(a=np.ones((2, 3)), b=np.ones((3, 7))), RequestOptions(), None, service.Stopwatch())
    with pytest.raises(InvalidParameter):
        await matmul.run(operands, RequestOptions(dtype="int8"), None, service.Stopwatch())
    assert len(engine.calls) == 1


def test_a_new_stopwatch_starts_at_the_perf_counters_now() -> None:
    before = perf_counter()
    clock = service.Stopwatch()
    assert before <= clock.received <= perf_counter()


def test_describe_names_how_the_product_was_made() -> None:
    described = _product(2, 3, 4, kernel_ms=1.0).describe()
    assert (described.dtype, described.kernel, described.tile, described.backend, described.device) == (
        "float32",
        "numpy",
        None,
        "cpu",
        "test",
    )
    assert described.roofline == ROOFLINE
