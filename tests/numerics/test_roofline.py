"""The roofline: each kernel's global-memory traffic by its access pattern, the device's peaks, the answer's fields."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from kernels.cuda import device_attributes
from kernels.registry import KERNELS
from matmul_tools.bodies import npy_bytes
from numerics.precision import Precision
from numerics.roofline import DevicePeaks, gpu_peaks, minimum_global_elements, roofline


@pytest.mark.parametrize(
    ("kernel", "tile", "mnk", "elements"),
    [
        # every thread reads its row of A and its column of B: 2mnk, + mn writes
        ("naive", None, (4, 3, 5), 4 * 5 * 3 + 5 * 3 * 4 + 4 * 3),
        # A once per block column (ceil(50/16) = 4), B once per block row (ceil(100/16) = 7)
        ("tiled", 16, (100, 50, 40), 100 * 40 * 4 + 40 * 50 * 7 + 100 * 50),
        ("tiled", 8, (1024, 1024, 1024), 2 * 1024**3 // 8 + 1024**2),
        ("tiled", 32, (1, 1, 1), 1 + 1 + 1),
        # a warp shares one read of A among its 32 columns; B is read by every output
        ("coalesced", None, (2, 40, 3), 2 * 3 * 2 + 3 * 40 * 2 + 2 * 40),
        ("blocktile1d", None, (4096, 4096, 4096), 2 * 4096**3 // 64 + 4096**2),
        ("blocktile2d", None, (300, 200, 7), 300 * 7 * 2 + 7 * 200 * 3 + 300 * 200),
        # fast runs 512^3 on its smallest block, 64x64: no tile yields 128 blocks there
        ("fast", None, (512, 512, 512), 2 * 512**3 // 64 + 512**2),
    ],
)
def test_each_kernel_requests_what_its_access_pattern_reads(
    kernel: str, tile: int | None, mnk: tuple[int, int, int], elements: int
) -> None:
    m, n, k = mnk
    config = KERNELS[kernel].config_for(m, n, k, tile)
    assert config.global_elements(m, n, k) == elements


def test_the_libraries_are_counted_at_the_minimum() -> None:
    assert minimum_global_elements(2, 3, 4) == 2 * 4 + 4 * 3 + 2 * 3
    assert minimum_global_elements(5, 0, 7) == 35


def test_tiling_divides_the_operand_reads_by_the_tile() -> None:
    m = n = k = 256
    naive = KERNELS["naive"].config_for(m, n, k, None).global_elements(m, n, k) - m * n
    for tile in (8, 16, 32):
        tiled = KERNELS["tiled"].config_for(m, n, k, tile).global_elements(m, n, k) - m * n
        assert naive == tile * tiled


FLOAT32 = np.dtype(np.float32)
H100 = {"multiprocessors": 132, "clock_khz": 1_980_000, "memory_clock_khz": 2_619_000, "memory_bus_width_bits": 5120}
"""An H100 80GB HBM3 SXM's attributes, as cudaDeviceGetAttribute reports them."""


def test_the_peaks_of_an_h100_from_its_attributes() -> None:
    peaks = gpu_peaks((9, 0), **H100)
    assert peaks.flops_per_s["float32"] == pytest.approx(66.9e12, rel=1e-3)  # 132 x 128 x 2 x 1.98 GHz
    assert peaks.flops_per_s["float64"] == pytest.approx(66.9e12, rel=1e-3)  # DMMA: 128 per SM, twice the lanes'
    assert peaks.flops_per_s["tf32"] == pytest.approx(535.3e12, rel=1e-3)  # 132 x 1024 x 2 x 1.98 GHz
    assert peaks.flops_per_s["3xtf32"] == pytest.approx(535.3e12 / 3, rel=1e-3)  # three TF32 products per product
    assert peaks.flops_per_s["bf16"] == peaks.flops_per_s["fp16"] == pytest.approx(1070.5e12, rel=1e-3)
    assert peaks.flops_per_s["int8"] == pytest.approx(2141.0e12, rel=1e-3)  # 132 x 4096 x 2 x 1.98 GHz
    assert peaks.dram_bytes_per_s == pytest.approx(3.352e12, rel=1e-3)  # 2.619 GHz x 640 bytes x 2


def test_an_a100_has_half_the_float32_lanes_per_sm() -> None:
    peaks = gpu_peaks(
        (8, 0), multiprocessors=108, clock_khz=1_410_000, memory_clock_khz=1_215_000, memory_bus_width_bits=5120
    )
    assert peaks.flops_per_s["float32"] == pytest.approx(19.5e12, rel=1e-2)
    assert peaks.flops_per_s["float64"] == pytest.approx(19.5e12, rel=1e-2)  # DMMA, twice the 9.7 of the lanes
    assert peaks.flops_per_s["tf32"] == pytest.approx(156e12, rel=1e-2)  # the A100 whitepaper's dense figures
    assert peaks.flops_per_s["bf16"] == peaks.flops_per_s["fp16"] == pytest.approx(312e12, rel=1e-2)
    assert peaks.dram_bytes_per_s == pytest.approx(1.555e12, rel=1e-2)


def test_where_no_tensor_core_does_float64_its_roof_is_the_lanes() -> None:
    peaks = gpu_peaks(
        (7, 0), multiprocessors=80, clock_khz=1_530_000, memory_clock_khz=None, memory_bus_width_bits=None
    )
    assert peaks.flops_per_s["float64"] == pytest.approx(7.8e12, rel=1e-2)  # a V100's 32 lanes per SM
    assert peaks.flops_per_s["fp16"] == pytest.approx(125e12, rel=1e-2)
    assert peaks.flops_per_s["bf16"] is None and peaks.flops_per_s["tf32"] is None  # it has neither


@pytest.mark.parametrize("missing", ["multiprocessors", "clock_khz", "memory_clock_khz", "memory_bus_width_bits"])
@pytest.mark.parametrize("as_", [None, 0])
def test_a_missing_or_zero_attribute_leaves_out_what_needs_it(missing: str, as_: int | None) -> None:
    peaks = gpu_peaks((9, 0), **(H100 | {missing: as_}))
    flops_known = missing in ("memory_clock_khz", "memory_bus_width_bits")
    assert (peaks.flops_per_s["float32"] is not None) == flops_known
    assert (peaks.dram_bytes_per_s is not None) == (not flops_known)


def test_an_unknown_compute_capability_has_no_flops_peak() -> None:
    peaks = gpu_peaks((99, 0), **H100)
    assert set(peaks.flops_per_s) == {"float32", "float64", *(p.value for p in Precision if p is not Precision.FP32)}
    assert set(peaks.flops_per_s.values()) == {None} and peaks.dram_bytes_per_s is not None


def test_the_roofline_of_tiled_against_an_h100() -> None:
    m = n = k = 4096
    config = KERNELS["tiled"].config_for(m, n, k, 16)
    line = roofline(
        config.global_elements(m, n, k), (m, n, k), FLOAT32, 1, kernel_ms=16.0, peaks=gpu_peaks((9, 0), **H100)
    )
    assert line.flops == 2 * 4096**3
    assert line.global_bytes == 4 * (2 * 4096**3 // 16 + 4096**2)
    assert line.intensity == pytest.approx(2 * 4096**3 / line.global_bytes)  # about 4 FLOP/B
    assert line.peak_gflops == pytest.approx(66908.2, abs=0.1)
    assert line.peak_fraction == pytest.approx(2 * 4096**3 / 16e-3 / 66.9082e12, rel=1e-6)
    assert line.global_gbps == pytest.approx(line.global_bytes / 16e-3 / 1e9)
    assert line.dram_gbps == pytest.approx(3352.3, abs=0.1)


@pytest.mark.parametrize(
    ("dtype", "precision", "roof"),
    [
        (np.float32, Precision.FP32, "float32"),
        (np.float64, Precision.FP32, "float64"),
        (np.float32, Precision.TF32, "tf32"),
        (np.float32, Precision.TF32X3, "3xtf32"),
        (np.float32, Precision.BF16, "bf16"),
        (np.float32, Precision.FP16, "fp16"),
    ],
)
def test_a_product_is_rated_against_its_arithmetics_roof(
    dtype: type[np.floating], precision: Precision, roof: str
) -> None:
    peaks = gpu_peaks((9, 0), **H100)
    elements = minimum_global_elements(4096, 4096, 4096)
    line = roofline(elements, (4096, 4096, 4096), np.dtype(dtype), 1, kernel_ms=1.0, peaks=peaks, precision=precision)
    peak = peaks.flops_per_s[roof]
    assert peak is not None and line.peak_gflops == pytest.approx(peak / 1e9)
    assert line.peak_fraction == pytest.approx(2 * 4096**3 / 1e-3 / peak)


def test_an_int32_products_traffic_is_int8_operands_and_an_int32_c_against_the_int8_roof() -> None:
    m, n, k = 4096, 2048, 1024
    peaks = gpu_peaks((9, 0), **H100)
    line = roofline(minimum_global_elements(m, n, k), (m, n, k), np.dtype(np.int32), 1, 0.1, peaks, Precision.INT8)
    assert line.global_bytes == m * k + k * n + 4 * m * n
    assert line.peak_gflops == pytest.approx(peaks.flops_per_s["int8"] / 1e9)
    assert line.peak_fraction == pytest.approx(2 * m * n * k / 1e-4 / peaks.flops_per_s["int8"])


def test_a_batch_is_rated_over_the_launch_and_a_library_at_the_minimum() -> None:
    line = roofline(minimum_global_elements(10, 20, 30), (10, 20, 30), np.dtype(np.float64), 4, 1.0, DevicePeaks())
    assert line.flops == 2 * 10 * 20 * 30 and line.global_bytes == 8 * (10 * 30 + 30 * 20 + 10 * 20)
    assert line.global_gbps == pytest.approx(4 * line.global_bytes / 1e-3 / 1e9)
    assert (line.peak_gflops, line.peak_fraction, line.dram_gbps) == (None, None, None)


@pytest.mark.parametrize(
    ("shape", "kernel_ms", "intensity"),
    [((3, 4, 0), 0.01, 0.0), ((0, 0, 5), 0.0, None), ((2, 2, 2), 0.0, 16 / (4 * 12))],
)
def test_nothing_to_rate_gives_nulls_not_errors(
    shape: tuple[int, int, int], kernel_ms: float, intensity: float | None
) -> None:
    line = roofline(minimum_global_elements(*shape), shape, FLOAT32, 1, kernel_ms, gpu_peaks((9, 0), **H100))
    assert line.intensity == intensity and line.peak_fraction is None
    assert line.global_gbps is None if kernel_ms == 0 else line.global_gbps == pytest.approx(4.8e-3)


def test_an_empty_stack_is_not_rated() -> None:
    """A launch of no products did no arithmetic and moved no bytes: its rates are unknown, not 0."""
    line = roofline(minimum_global_elements(4, 2, 5), (4, 2, 5), FLOAT32, 0, 0.01, gpu_peaks((9, 0), **H100))
    assert line.flops == 2 * 4 * 2 * 5 and line.global_bytes == 4 * (4 * 5 + 5 * 2 + 4 * 2)
    assert (line.peak_fraction, line.global_gbps) == (None, None)


ROOFLINE_FIELDS = ["flops", "global_bytes", "intensity", "peak_gflops", "peak_fraction", "global_gbps", "dram_gbps"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kernel", "tile", "elements"),
    [("naive", None, 2 * 96**3 + 96**2), ("tiled", 8, 2 * 96**3 // 8 + 96**2), ("numpy", None, 3 * 96**2)],
)
async def test_every_answer_carries_the_roofline(
    client: httpx.AsyncClient, kernel: str, tile: int | None, elements: int
) -> None:
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((96, 96)).astype(np.float32), rng.standard_normal((96, 96)).astype(np.float32)
    params = {"kernel": kernel} | ({"tile": tile} if tile else {})
    files = {"a": ("a.npy", npy_bytes(a)), "b": ("b.npy", npy_bytes(b))}

    doc = (await client.post("/matmul", params=params, files=files)).json()
    line = doc["roofline"]
    assert list(line) == ROOFLINE_FIELDS
    assert line["flops"] == 2 * 96**3 and line["global_bytes"] == 4 * elements
    assert line["intensity"] == pytest.approx(line["flops"] / line["global_bytes"])
    assert line["global_gbps"] == pytest.approx(line["global_bytes"] / doc["timing"]["kernel_ms"] / 1e6, rel=1e-6)
    assert (line["peak_gflops"], line["peak_fraction"], line["dram_gbps"]) == (None, None, None)  # a CPU has none

    r = await client.post("/matmul", params=params, files=files, headers={"accept": "application/x-npy"})
    roofline_headers = {name: value for name, value in r.headers.items() if name.startswith("x-matmul-roofline-")}
    assert roofline_headers.keys() == {
        "x-matmul-roofline-flops",
        "x-matmul-roofline-global-bytes",
        "x-matmul-roofline-intensity",
        "x-matmul-roofline-global-gbps",
    }
    assert int(roofline_headers["x-matmul-roofline-flops"]) == 2 * 96**3
    assert int(roofline_headers["x-matmul-roofline-global-bytes"]) == 4 * elements
    assert float(roofline_headers["x-matmul-roofline-intensity"]) == pytest.approx(line["intensity"], rel=1e-5)

    infer = {
        "inputs": [
            {"name": "A", "shape": [96, 96], "datatype": "FP32", "data": a.reshape(-1).tolist()},
            {"name": "B", "shape": [96, 96], "datatype": "FP32", "data": b.reshape(-1).tolist()},
        ],
        "parameters": params,
    }
    parameters = (await client.post("/v2/models/matmul/infer", json=infer)).json()["parameters"]
    assert {name for name in parameters if name.startswith("roofline_")} == {
        "roofline_flops",
        "roofline_global_bytes",
        "roofline_intensity",
        "roofline_global_gbps",
    }
    assert parameters["roofline_global_bytes"] == 4 * elements and parameters["kernel"] == kernel


class _FakeRuntimeError(Exception):
    pass


def _fake_cupy(attributes: dict[int, int]) -> SimpleNamespace:
    """What `device_attributes` uses of CuPy: deviceGetAttribute, raising for an attribute it does not know."""

    def get(attribute: int, device: int) -> int:
        if attribute not in attributes:
            raise _FakeRuntimeError(f"cudaErrorInvalidValue: attribute {attribute}")
        return attributes[attribute]

    runtime = SimpleNamespace(deviceGetAttribute=get, CUDARuntimeError=_FakeRuntimeError)
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))


def test_a_device_attribute_that_errors_or_reads_0_is_not_known() -> None:
    cupy = _fake_cupy({16: 132, 13: 1_980_000, 36: 0})  # no 37: the bus width is refused
    attributes = device_attributes(cupy, 0)
    assert attributes == {
        "multiprocessors": 132,
        "clock_khz": 1_980_000,
        "memory_clock_khz": None,
        "memory_bus_width_bits": None,
    }
    peaks = gpu_peaks((9, 0), **attributes)
    assert peaks.flops_per_s["float32"] == pytest.approx(66.9e12, rel=1e-3) and peaks.dram_bytes_per_s is None
