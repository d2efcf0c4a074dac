"""scripts/bench_kernels.py's plots, drawn on CPU from fabricated results (the sweep itself needs a GPU)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.scripts import import_script

bench = import_script("bench_kernels")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
META = {
    "date": "2026-01-01 00:00 UTC",
    "device": "a fabricated device",
    "configs": "chosen",
    "peak_gflops": {"float32": 66908.16, "float64": 33454.08},
    "dram_gbps": 3352.32,
}


def fabricated_results() -> list[Any]:
    """A made-up sweep: every (kernel, shape, dtype) at a made-up rate, one run skipped as too slow."""
    rows = []
    for dtype in ("float32", "float64"):
        for m, n, k in [(1024, 1024, 1024), (2048, 2048, 2048), (17, 9, 33)]:
            for kernel, config in [("cublas", ""), ("naive", "16x16"), ("tiled", "16"), ("fast", "64x64x16-s3-scalar")]:
                ms = {"cublas": 1.0, "naive": 10.0, "tiled": 7.0, "fast": 1.1}[kernel] * m * n * k / 1e9
                rows.append(bench.Result(kernel, config, dtype, m, n, k, ms, 2 * m * n * k / ms / 1e6, None, 0.0))
    rows.append(bench.Result("naive", "16x16", "float32", 8192, 8192, 8192, None, None, None, None, "skipped (slow)"))
    return rows


@pytest.mark.parametrize(
    ("kernel", "config", "dtype", "expected"),
    [
        ("naive", "16x16", "float32", 2 * 64**3 / (4 * (2 * 64**3 + 64**2))),  # about 1/4 FLOP per byte
        ("tiled", "16", "float32", 2 * 64**3 / (4 * (2 * 64**3 // 16 + 64**2))),  # about 4
        ("tiled", "32", "float64", 2 * 64**3 / (8 * (2 * 64**3 // 32 + 64**2))),
        ("cublas", "", "float32", 2 * 64**3 / (4 * 3 * 64**2)),
    ],
)
def test_the_intensity_of_a_run_is_its_instances_flops_per_byte(
    kernel: str, config: str, dtype: str, expected: float
) -> None:
    run = bench.Result(kernel, config, dtype, 64, 64, 64, 1.0, 1.0, None, 0.0)
    assert bench.intensity(run) == pytest.approx(expected)


def test_the_roofline_plot_is_written_beside_the_gflops_plot(tmp_path: Path) -> None:
    path = tmp_path / "bench_kernels.json"
    path.write_text(json.dumps({"meta": META, "results": [asdict(r) for r in fabricated_results()]}))
    assert bench.main(["--replot", str(path)]) == 0
    assert (tmp_path / "bench_kernels.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "bench_kernels_roofline.png").read_bytes().startswith(PNG_MAGIC)


def test_a_run_that_recorded_no_peaks_gets_its_points_without_roofs(tmp_path: Path) -> None:
    """JSONs written before the roofline have no peaks; a device may not report them."""
    meta = {key: value for key, value in META.items() if key not in ("peak_gflops", "dram_gbps")}
    path = tmp_path / "roofline.png"
    assert bench.write_roofline_plot(fabricated_results(), meta, path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_int8_rows_get_their_gflops_panel_and_no_roofline(tmp_path: Path) -> None:
    """int8 products have no FMA roof: a JSON of int8 rows alone draws its GFLOP/s plot and no roofline."""
    rows = [
        bench.Result(kernel, config, "int8", n, n, n, ms, 2 * n**3 / ms / 1e6, 1.0, 0.0, precision="int8")
        for n in (2048, 4096)
        for kernel, config, ms in (("cublas", "", 0.1), ("wgmma", "", 0.08), ("wgmma", "B^T given", 0.07))
    ]
    path = tmp_path / "bench_kernels.json"
    path.write_text(json.dumps({"meta": META, "results": [asdict(r) for r in rows]}))
    assert bench.main(["--replot", str(path)]) == 0
    assert (tmp_path / "bench_kernels.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "bench_kernels_roofline.png").exists()


@pytest.mark.parametrize(("dtypes", "accepted"), [("int8", True), ("float32,int8", True), ("int16", False)])
def test_int8_is_a_dtype_the_sweep_takes(dtypes: str, accepted: bool) -> None:
    if accepted:
        assert bench.parse_args(["--dtypes", dtypes]).dtypes == dtypes.split(",")
    else:
        with pytest.raises(SystemExit):
            bench.parse_args(["--dtypes", dtypes])


def test_a_ratio_just_under_a_bar_is_not_printed_as_the_bar() -> None:
    """The bars are ratios such as 0.9 of cuBLASLt: 0.8958 must not read as 0.90 in the table."""
    row = bench.Result("wgmma", "e4m3 given", "float32", 4096, 4096, 4096, 0.1253, 1_097_000.0, 0.8958, 1.592)
    assert " 0.896 " in bench.format_row(row)


def test_a_replot_of_a_missing_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(["--replot", str(tmp_path / "missing.json")])
    assert exited.value.code == 2
