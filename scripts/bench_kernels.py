"""Benchmark every registered kernel against cuBLAS (cupy.matmul, TF32 off) on the current GPU.

Each (kernel, shape, dtype) is first checked against a float64 product of the same inputs (every element within
numerics/reference.py's bound, on an output poisoned with NaN beforehand, so an unwritten element fails), then timed:
warm-up launches, then at least --repeats launches each between its own pair of CUDA events, with L2 flushed
before each (a buffer twice the L2 size is rewritten) and the inputs rotated among several sets; the median
is reported. GFLOP/s = 2*m*n*k / t; the ratio is to cuBLAS measured in the same run on the same inputs, in the same
precision (--precisions: cuBLAS in the tensor-core modes, and `mma_sync` and `wgmma` in each where the device runs
them; `dmma` against cuBLAS DGEMM in float64), and `sgemm_ratio` is every row's to cuBLAS SGEMM.
Prints a table, writes bench_kernels.json, bench_kernels.png (GFLOP/s against size, one line per kernel,
cuBLAS dashed) and bench_kernels_roofline.png (GFLOP/s against arithmetic intensity, the FLOP/byte of the
global-memory requests each kernel's access pattern makes, one point per kernel and shape, under the device's
compute and memory roofs; see docs/roofline.md) under --out.

    python scripts/bench_kernels.py                       # the whole sweep, both dtypes
    python scripts/bench_kernels.py --kernels fast --sizes 4096 --dtypes float32 --no-odd
    python scripts/bench_kernels.py --kernels fast --configs all --sizes 2048,4096   # every instance
    python scripts/bench_kernels.py --kernels fast,mma_sync,wgmma,dmma --sizes 4096,8192 \
        --precisions tf32,3xtf32,bf16,fp16                # the tensor-core ladder against cuBLAS in each mode
    python scripts/bench_kernels.py --kernels mma_sync,wgmma --sizes 4096,8192 --dtypes int8   # exact int8 products
    python scripts/bench_kernels.py --kernels wgmma --sizes 4096,8192 --dtypes float32 --precisions fp8 --no-odd
    python scripts/bench_kernels.py --kernels wgmma --sizes 2048,4096,8192 --dtypes float32 --precisions fp8 \
        --no-odd --configs all                            # every FP8 instance, where each pays
    python scripts/bench_kernels.py --stack 10000 --sizes 64,256 --dtypes float32   # stacks of products, one launch

fp8 (--precisions fp8) has no cuBLAS row: cuBLAS's GemmEx has no FP8 types. Its reference is cuBLASLt through
PyTorch, where PyTorch is installed: `torch._scaled_mm` with per-tensor scales and float32 C (row "cublaslt"),
timed two ways as `wgmma`'s FP8 instance is: from the float32 operands, each side measuring their largest magnitudes,
scaling them by the same powers of two and rounding them to e4m3 itself (PyTorch's amax, frexp, multiply and cast;
config ""), and from the e4m3 operands as both read them, the same bytes and scales (config "e4m3 given"). With
--configs all, each of `wgmma`'s FP8 instances again from the e4m3 operands (configs "e4m3 given, 128 wide", "..., 176
wide", "..., 176 persistent", and so on for each width of `tensorcore.FP8_WIDTHS`), each against cuBLASLt's "e4m3
given" row: what `tensorcore.wgmma_fp8_config`'s choice of width and grid is measured by. With --configs all, tf32
rows also time each of `wgmma`'s TF32 instances on the same operands (configs "rows", reading A and B as they lie,
and "passes", converting them first), against cuBLAS TF32.

int8 (--dtypes int8) products are exact: each is compared with the int64 product element for element (WRONG at one
difference, on an output poisoned with a value no element of it has), then timed from the same row-major int8 A and
B as the others, cuBLAS transposing B for its integer tensor cores (GemmEx, TN, CUBLAS_COMPUTE_32I) and `wgmma`'s and
`mma_sync`'s int8 instances transposing it with kernels/operands.cu; and cuBLAS and `wgmma` again from A and B^T as
both read them (config "B^T given"), each ratio to cuBLAS timed the same way.

--stack B times stacks of B products of each square size, (B, m, k) @ (B, k, n) in one launch, as the service
computes a stack: cuBLAS (cupy.matmul, strided-batched), the FMA kernels that take stacks, and `torch.bmm` where
PyTorch is installed; GFLOP/s count every product of the stack, and each ratio is to cuBLAS's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kernels import tensorcore
from kernels.catalogue import CUBLAS, DTYPES, RUNGS, TENSOR_CORE_PRECISIONS
from kernels.cublas import cublas_int8_product
from kernels.cuda import Launcher, device_attributes
from kernels.registry import KERNELS, KernelSpec, LaunchConfig
from kernels.tensorcore import DMMA, KERNEL_NAMES, MMA_SYNC, WGMMA
from numerics.precision import Precision
from numerics.reference import BOUND_CONSTANT, Reference
from numerics.roofline import DevicePeaks, gpu_peaks, minimum_global_elements, roofline

SQUARE_SIZES = (256, 512, 1024, 2048, 4096, 8192)
ODD_SHAPES = ((1, 1, 1), (17, 9, 33), (1000, 1000, 1), (4095, 31, 4097), (4093, 4099, 4097))
"""(m, n, k): C is m x n, the inner dimension k. Sides that are not multiples of any tile or vector width."""
HEADLINE_SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4093, 4099, 4097))
"""The shapes the issue sets bars at; the run ends with their rows."""
SLOW_KERNELS = ("naive", "tiled", "coalesced")
SLOW_FLOP_LIMIT = {"float32": 2 * 4096**3, "float64": 2 * 2048**3}
"""The teaching kernels are skipped above these sizes: they would take most of the run's time."""
INPUT_BYTES_BUDGET = 6 << 30
"""Rotate among up to 4 input sets, fewer when that would take more device memory than this."""
INT8 = "int8"
"""The dtype (and precision) of exact int8 products, into int32."""
BENCH_DTYPES = (*DTYPES, INT8)


@dataclass
class Result:
    kernel: str
    config: str
    dtype: str
    m: int
    n: int
    k: int
    ms: float | None
    gflops: float | None
    ratio: float | None
    error_ratio: float | None = None
    """The largest |C - R| / (sqrt(k) u |A||B|) of the product (numerics/reference.py): wrong past BOUND_CONSTANT."""
    note: str = ""
    precision: str = "fp32"
    """The mode the product ran in (numerics/precision.py); `ratio` is to cuBLAS in the same mode."""
    sgemm_ratio: float | None = None
    """cuBLAS SGEMM's time (the float32 product in fp32) over this row's; None for float64."""
    relative_error: float | None = None
    """||C - R|| / ||R|| (Frobenius) against the float64 product of the float32 operands."""
    batch: int = 1
    """Products in the launch: --stack's B, each m x k by k x n."""

    @property
    def flop(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def shape_name(m: int, n: int, k: int, batch: int = 1) -> str:
    matrices = f"{m}^3" if m == n == k else f"{m}x{k}@{k}x{n}"
    return matrices if batch == 1 else f"{batch}x {matrices}"


class Bench:
    def __init__(self, repeats: int, warmup: int) -> None:
        import cupy

        self.cp = cupy
        self.repeats = repeats
        self.warmup = warmup
        l2 = int(cupy.cuda.Device().attributes["L2CacheSize"])
        self.flush = cupy.empty(2 * l2 // 4, dtype=cupy.float32)
        self.launcher = Launcher()

    def inputs(self, m: int, n: int, k: int, dtype: str, batch: int = 1) -> tuple[list[tuple[Any, Any]], Reference]:
        """Fresh random input sets (standard normal; stacks of `batch` matrices where it is over 1) and the
        reference of the first, computed on the device."""
        cp = self.cp
        itemsize = 4 if dtype == "float32" else 8
        per_set = batch * (m * k + k * n) * itemsize
        count = max(1, min(4, INPUT_BYTES_BUDGET // max(per_set, 1)))
        lead = (batch,) if batch > 1 else ()
        sets = [
            (
                cp.random.standard_normal((*lead, m, k)).astype(dtype),
                cp.random.standard_normal((*lead, k, n)).astype(dtype),
            )
            for _ in range(count)
        ]
        a, b = sets[0]
        return sets, Reference.of(a, b, dtype)

    def error(
        self, run: Any, sets: list[tuple[Any, ...]], reference: Reference, dtype: str, n: int | None = None
    ) -> tuple[float, float]:
        """The error ratio and the relative error of `run(*sets[0], c)`, written into an output poisoned with NaN
        (C has the first operand's rows and n columns, by default the second's)."""
        c = self.cp.full(_c_shape(sets[0], n), self.cp.nan, dtype=dtype)
        run(*sets[0], c)
        return reference.error_ratio(c), reference.relative_error(c)

    def time(self, run: Any, sets: list[tuple[Any, ...]], dtype: str, n: int | None = None) -> float:
        """Median milliseconds of one `run(*operands, c)`, L2 flushed before each and the input sets rotated (C has
        the first operand's rows and n columns, by default the second's)."""
        cp = self.cp
        outputs = [cp.empty(_c_shape(operands, n), dtype=dtype) for operands in sets]
        for i in range(self.warmup):
            run(*sets[i % len(sets)], outputs[i % len(sets)])
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(self.repeats)]
        for i, (start, end) in enumerate(events):
            self.flush.fill(i)
            start.record()
            run(*sets[i % len(sets)], outputs[i % len(sets)])
            end.record()
        events[-1][1].synchronize()
        return float(statistics.median(cp.cuda.get_elapsed_time(start, end) for start, end in events))

    def run(self, kernel: str, precision: Precision = Precision.FP32, config: LaunchConfig | None = None) -> Any:
        """c = a @ b by the rung `kernel` in `precision` (the FMA kernels in their instance `config`)."""
        return lambda a, b, c: self.launcher.launch(kernel, a, b, c, precision=precision, config=config)

    def int8_inputs(self, m: int, n: int, k: int) -> list[tuple[Any, Any]]:
        """Fresh int8 input sets, uniform over int8's range."""
        cp = self.cp
        count = max(1, min(4, INPUT_BYTES_BUDGET // max(m * k + k * n + 4 * m * n, 1)))
        return [
            (cp.random.randint(-128, 128, (m, k)).astype(cp.int8), cp.random.randint(-128, 128, (k, n)).astype(cp.int8))
            for _ in range(count)
        ]

    def int8_mismatches(self, run: Any, sets: list[tuple[Any, Any]], transposed: bool) -> int:
        """Elements of the first set's product (b given as B^T when `transposed`) that differ from its int64 product
        (computed on the device in float64, exact while the sums stay under 2^53), written into an output poisoned
        with INT32_MIN."""
        cp = self.cp
        a, b = sets[0]
        c = cp.full((a.shape[0], b.shape[0] if transposed else b.shape[1]), np.iinfo(np.int32).min, dtype=cp.int32)
        run(a, b, c)
        exact = cp.matmul(a.astype(cp.float64), (b.T if transposed else b).astype(cp.float64))
        return int(cp.count_nonzero(c.astype(cp.float64) != exact))


def _c_shape(operands: tuple[Any, ...], n: int | None) -> tuple[int, ...]:
    """C's shape: the first operand's but its last side, n or the second operand's (a stack's too)."""
    return (*operands[0].shape[:-1], operands[1].shape[-1] if n is None else n)


def plan(kernels: list[str], all_configs: bool, m: int, n: int, k: int) -> list[tuple[KernelSpec, LaunchConfig]]:
    runs: list[tuple[KernelSpec, LaunchConfig]] = []
    for name in kernels:
        spec = KERNELS[name]
        configs = [c for c in spec.configs if c.accepts(n, k)] if all_configs else [spec.config_for(m, n, k, None)]
        runs.extend((spec, config) for config in configs)
    return runs


def run_sweep(args: argparse.Namespace) -> tuple[list[Result], dict[str, Any]]:
    import cupy

    bench = Bench(args.repeats, args.warmup)
    shapes = [(s, s, s) for s in args.sizes] + ([] if args.no_odd else list(ODD_SHAPES))
    results: list[Result] = []
    for dtype in args.dtypes:
        if args.stack:
            results += [row for size in args.sizes for row in stack_rows(bench, args, size, dtype)]
            continue
        if dtype == INT8:
            results += [row for m, n, k in shapes for row in int8_rows(bench, args, m, n, k)]
            continue
        for m, n, k in shapes:
            flop = 2 * m * n * k
            sets, reference = bench.inputs(m, n, k, dtype)
            cublas = Result(CUBLAS, "", dtype, m, n, k, None, None, None)
            cublas.error_ratio, cublas.relative_error = bench.error(bench.run(CUBLAS), sets, reference, dtype)
            if not args.check_only:
                cublas.ms = bench.time(bench.run(CUBLAS), sets, dtype)
                cublas.gflops, cublas.ratio = flop / cublas.ms / 1e6, 1.0
            rows = [cublas]
            for precision in args.precisions if dtype == "float32" else []:
                in_mode = Reference.of(*sets[0], dtype, precision)
                if precision is Precision.FP8:
                    rows += fp8_rows(bench, args, sets, in_mode)
                    del in_mode
                    continue
                library = Result(CUBLAS, "", dtype, m, n, k, None, None, None, precision=precision)
                rows.append(library)
                measure(bench, args, library, bench.run(CUBLAS, precision), sets, in_mode, None)
                for name in (MMA_SYNC, WGMMA):
                    if name in args.kernels and bench.launcher.runs(name) and precision in RUNGS[name].precisions:
                        own = Result(name, "", dtype, m, n, k, None, None, None, precision=precision)
                        rows.append(own)
                        measure(bench, args, own, bench.run(name, precision), sets, in_mode, library.ms)
                if precision is Precision.TF32 and args.configs == "all":
                    rows += tf32_instance_rows(bench, args, sets, in_mode, library.ms)
                del in_mode
            if dtype == "float64" and DMMA in args.kernels and bench.launcher.runs(DMMA):
                own = Result(DMMA, "", dtype, m, n, k, None, None, None)
                rows.append(own)
                measure(bench, args, own, bench.run(DMMA), sets, reference, cublas.ms)
            for row in rows:
                if dtype == "float32" and row.ms is not None and cublas.ms is not None:
                    row.sgemm_ratio = cublas.ms / row.ms
            for spec, config in plan(
                [name for name in args.kernels if name in KERNELS], args.configs == "all", m, n, k
            ):
                row = Result(spec.name, config.label, dtype, m, n, k, None, None, None)
                rows.append(row)
                if spec.name in SLOW_KERNELS and flop > SLOW_FLOP_LIMIT[dtype] and not args.include_slow:
                    row.note = "skipped (slow)"
                    continue
                measure(bench, args, row, bench.run(spec.name, config=config), sets, reference, cublas.ms)
            print_rows(rows)
            results.extend(rows)
            del sets, reference
            cupy.get_default_memory_pool().free_all_blocks()
    device = cupy.cuda.Device().id
    properties = cupy.cuda.runtime.getDeviceProperties(device)
    peaks = gpu_peaks((properties["major"], properties["minor"]), **device_attributes(cupy, device))
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": properties["name"].decode(),
        "multiprocessors": properties["multiProcessorCount"],
        "peak_gflops": {dtype: None if f is None else f / 1e9 for dtype, f in peaks.flops_per_s.items()},
        "dram_gbps": None if peaks.dram_bytes_per_s is None else peaks.dram_bytes_per_s / 1e9,
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "timing": "CUDA events around each launch, L2 flushed before each, inputs rotated; median",
    }
    return results, meta


def stack_rows(bench: Bench, args: argparse.Namespace, size: int, dtype: str) -> list[Result]:
    """A stack of --stack size^3 products in one launch: cuBLAS (cupy.matmul, strided-batched), `torch.bmm` where
    PyTorch is installed, and each FMA kernel that takes stacks, each ratio to cuBLAS."""
    sets, reference = bench.inputs(size, size, size, dtype, args.stack)
    cublas = Result(CUBLAS, "", dtype, size, size, size, None, None, None, batch=args.stack)
    measure(bench, args, cublas, bench.run(CUBLAS), sets, reference, None)
    rows = [cublas]
    bmm = _torch_bmm()
    if bmm is not None:
        rows.append(Result("torch.bmm", "", dtype, size, size, size, None, None, None, batch=args.stack))
        measure(bench, args, rows[-1], bmm, sets, reference, cublas.ms)
    stacking = [name for name in args.kernels if name in KERNELS and KERNELS[name].batched]
    for spec, config in plan(stacking, args.configs == "all", size, size, size):
        rows.append(Result(spec.name, config.label, dtype, size, size, size, None, None, None, batch=args.stack))
        measure(bench, args, rows[-1], bench.run(spec.name, config=config), sets, reference, cublas.ms)
    print_rows(rows)
    bench.cp.get_default_memory_pool().free_all_blocks()
    return rows


def _torch_bmm() -> Callable[[Any, Any, Any], Any] | None:
    """c = a @ b by `torch.bmm` (cuBLAS's batched GEMM through PyTorch, TF32 off) on CuPy stacks, each viewed as a
    tensor once (DLPack, no copy) so that the timed launches are bmm's alone; None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    tensors: dict[int, Any] = {}

    def tensor(x: Any) -> Any:
        if x.data.ptr not in tensors:
            tensors[x.data.ptr] = torch.from_dlpack(x)
        return tensors[x.data.ptr]

    return lambda a, b, c: torch.bmm(tensor(a), tensor(b), out=tensor(c))


def tf32_instance_rows(
    bench: Bench, args: argparse.Namespace, sets: list[tuple[Any, Any]], reference: Reference, library_ms: float | None
) -> list[Result]:
    """With --configs all, each of wgmma's TF32 instances (config "rows", reading the operands as they lie, and
    "passes", converting them first) on the same float32 sets."""
    tensor_cores = bench.launcher.tensor_cores
    if tensor_cores is None or WGMMA not in args.kernels or not bench.launcher.runs(WGMMA):
        return []
    (m, k), n = sets[0][0].shape, sets[0][1].shape[1]
    rows = []
    for label, instance in tensorcore.WGMMA_TF32_INSTANCES.items():
        row = Result(WGMMA, label, "float32", m, n, k, None, None, None, precision=Precision.TF32)
        rows.append(row)
        run = functools.partial(tensor_cores.wgmma_tf32, config=instance)
        measure(bench, args, row, run, sets, reference, library_ms)
    return rows


def int8_rows(bench: Bench, args: argparse.Namespace, m: int, n: int, k: int) -> list[Result]:
    """cuBLAS's, mma_sync's and wgmma's exact int8 product of one shape, checked, then timed two ways: from row-major
    A and B (each transposing B itself: config "") and from A and B^T as the tensor cores read them (config "B^T
    given"). With --configs all, wgmma's two instances each (config "... tiles" and "... turns"), whichever k
    chooses."""
    from cupy_backends.cuda.libs.cublas import CUBLASError

    sets = bench.int8_inputs(m, n, k)
    given = [(a, bench.cp.ascontiguousarray(b.T)) for a, b in sets]
    # each kernel from row-major B, and cuBLAS and wgmma from B^T as well (mma_sync takes no B^T)
    ways: dict[str, dict[tuple[str, str], Any]] = {
        "": {(CUBLAS, ""): cublas_int8_product},
        "B^T given": {(CUBLAS, ""): functools.partial(cublas_int8_product, b_transposed=True)},
    }
    tensor_cores = bench.launcher.tensor_cores
    if MMA_SYNC in args.kernels and bench.launcher.runs(MMA_SYNC):
        ways[""][(MMA_SYNC, "")] = bench.run(MMA_SYNC, Precision.INT8)
    if WGMMA in args.kernels and bench.launcher.runs(WGMMA) and tensor_cores is not None:
        instances: Mapping[str, tensorcore.WgmmaConfig | tensorcore.PingPongConfig | None] = {"": None}
        if args.configs == "all":
            instances = tensorcore.WGMMA_INT8_INSTANCES
        for label, instance in instances.items():
            ways[""][(WGMMA, label)] = functools.partial(tensor_cores.wgmma_int8, config=instance)
            ways["B^T given"][(WGMMA, label)] = functools.partial(
                tensor_cores.wgmma_int8, b_transposed=True, config=instance
            )
    rows = []
    for (config, runs), (inputs, transposed) in zip(ways.items(), ((sets, False), (given, True)), strict=True):
        library_ms = None
        for (name, instance_label), run in runs.items():
            row = Result(
                name, " ".join(filter(None, (config, instance_label))), INT8, m, n, k, None, None, None, precision=INT8
            )
            rows.append(row)
            try:
                mismatches = bench.int8_mismatches(run, inputs, transposed)
            except CUBLASError as exc:  # IMMA has layout rules of its own (K a multiple of 4, ...)
                row.note = f"cuBLAS refused: {exc}"
                continue
            row.error_ratio, row.relative_error = float(mismatches), mismatches / max(m * n, 1)  # 0: exact
            if mismatches:
                row.note = "WRONG"
            elif not args.check_only:
                row.ms = bench.time(run, inputs, "int32", n)
                row.gflops = 2 * m * n * k / row.ms / 1e6
                library_ms = row.ms if name == CUBLAS else library_ms
                row.ratio = None if library_ms is None else library_ms / row.ms
    print_rows(rows)
    del sets, given
    bench.cp.get_default_memory_pool().free_all_blocks()
    return rows


CUBLASLT = "cublaslt"
"""cuBLASLt through PyTorch: the FP8 reference (cuBLAS's GemmEx has none)."""


def fp8_rows(bench: Bench, args: argparse.Namespace, sets: list[tuple[Any, Any]], reference: Reference) -> list[Result]:
    """cuBLASLt's and wgmma's FP8 product of one shape (float32 sets), checked against the bound, then timed from the
    float32 operands (config "") and from the e4m3 operands as both read them (config "e4m3 given"); cuBLASLt's rows
    only where PyTorch is installed, each wgmma ratio to cuBLASLt timed the same way. With --configs all, each of
    wgmma's FP8 instances from the e4m3 operands as well (config "e4m3 given, 176 wide", ...), whichever the shape
    chooses: where its tiles' width and persistence pay."""
    tensor_cores = bench.launcher.tensor_cores
    if tensor_cores is None or WGMMA not in args.kernels:
        return []
    (m, k), n = sets[0][0].shape, sets[0][1].shape[1]
    converted: list[tuple[Any, ...]] = [(*tensor_cores.e4m3_operands(a, b), k) for a, b in sets]
    ways: dict[str, dict[str, tuple[Any, list[tuple[Any, ...]]]]] = {"": {}, "e4m3 given": {}}
    cublaslt = _cublaslt_fp8()
    if cublaslt is not None:
        ways[""][CUBLASLT] = (cublaslt.from_float32, list(sets))
        ways["e4m3 given"][CUBLASLT] = (cublaslt.from_e4m3, [cublaslt.e4m3_operands(*x) for x in converted])
    ways[""][WGMMA] = (bench.run(WGMMA, Precision.FP8), list(sets))
    ways["e4m3 given"][WGMMA] = (tensor_cores.wgmma_e4m3, converted)
    if args.configs == "all":
        for label, instance in tensorcore.WGMMA_FP8_INSTANCES.items():
            ways[f"e4m3 given, {label}"] = {
                WGMMA: (functools.partial(tensor_cores.wgmma_e4m3, config=instance), converted)
            }
    rows = []
    library_ms: dict[str, float | None] = {}  # cuBLASLt's, by the operands it was timed from
    for config, runs in ways.items():
        operands = "e4m3 given" if config.startswith("e4m3 given") else ""
        for name, (run, inputs) in runs.items():
            row = Result(name, config, "float32", m, n, k, None, None, None, precision=Precision.FP8)
            rows.append(row)
            measure(bench, args, row, run, inputs, reference, library_ms.get(operands), n)
            if name == CUBLASLT:
                library_ms[operands] = row.ms
            elif library_ms.get(operands) is None:
                row.ratio = None  # nothing to compare with
    return rows


@dataclass(frozen=True)
class _CublasLtFp8:
    """torch._scaled_mm (cuBLASLt) with per-tensor power-of-two scales, float32 C written into CuPy's array."""

    torch: Any

    def e4m3_operands(self, a_e4m3: Any, b_t_e4m3: Any, amax: Any, k: int) -> tuple[Any, Any, Any, Any]:
        """`TensorCoreLibrary.e4m3_operands` as cuBLASLt takes them: the same bytes as float8 tensors (B column-major)
        and the inverse scales, computed here, before any timing, as wgmma's instance computes its own in its
        epilogue."""
        torch = self.torch
        e4m3 = torch.float8_e4m3fn
        a = torch.as_tensor(a_e4m3[:, :k]).view(e4m3)
        b = torch.as_tensor(b_t_e4m3[:, :k]).view(e4m3).t()
        scale_a, scale_b = self._inverse_scales(torch.as_tensor(amax).view(torch.float32))
        return a, b, scale_a, scale_b

    def from_e4m3(self, a: Any, b: Any, scale_a: Any, scale_b: Any, c: Any) -> None:
        """From `e4m3_operands`: the same bytes as wgmma's, scaled back by the same powers of two."""
        torch = self.torch
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, out=torch.as_tensor(c))

    def from_float32(self, a: Any, b: Any, c: Any) -> None:
        """What a PyTorch user writes: each operand's largest magnitude, its power-of-two scale, the cast to e4m3
        (B^T's rows made contiguous), then the product."""
        torch = self.torch
        a_float, b_float = torch.as_tensor(a), torch.as_tensor(b)
        scale_a, scale_b = self._inverse_scales(torch.stack([a_float.abs().amax(), b_float.abs().amax()]))
        a_e4m3 = (a_float / scale_a).to(torch.float8_e4m3fn)
        b_e4m3 = (b_float.t() / scale_b).to(torch.float8_e4m3fn).contiguous().t()
        torch._scaled_mm(
            a_e4m3, b_e4m3, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, out=torch.as_tensor(c)
        )

    def _inverse_scales(self, amax: Any) -> tuple[Any, Any]:
        """2^-e for A's and B's largest magnitudes (a tensor of two): numerics/precision.py's e4m3_scale_exponent,
        on the device; each its own tensor, since cuBLASLt refuses a scale that is an element of another."""
        torch = self.torch
        fraction, exponent = torch.frexp(amax)
        scale_exponent = torch.where(amax == 0, 0, torch.where(fraction <= 0.875, 9, 8) - exponent)
        inverse = torch.ldexp(torch.ones_like(amax), -scale_exponent)
        return inverse[0].clone(), inverse[1].clone()


def _cublaslt_fp8() -> _CublasLtFp8 | None:
    try:
        import torch
    except ImportError:
        return None
    return _CublasLtFp8(torch)


def measure(
    bench: Bench,
    args: argparse.Namespace,
    row: Result,
    run: Any,
    sets: list[tuple[Any, Any]],
    reference: Reference,
    library_ms: float | None,
    n: int | None = None,
) -> None:
    """Check `run` against `reference`, then (unless --check-only) time it into `row`; its ratio is to
    `library_ms`, cuBLAS's time in the same mode (None: the row is cuBLAS's own, 1.0; timed whenever a row is). C
    has n columns (by default the second operand's)."""
    row.error_ratio, row.relative_error = bench.error(run, sets, reference, row.dtype, n)
    if not row.error_ratio <= BOUND_CONSTANT:
        row.note = "WRONG"
    elif not args.check_only:
        row.ms = bench.time(run, sets, row.dtype, n)
        row.gflops = row.flop / row.ms / 1e6
        row.ratio = 1.0 if library_ms is None else library_ms / row.ms


def format_row(r: Result) -> str:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    kernel = label(f"{r.kernel}/{r.config}" if r.config else r.kernel, r)
    return (
        f"{kernel:<40} {shape_name(r.m, r.n, r.k, r.batch):<20} {r.dtype:<8} {number(r.ms, '10.3f')} "
        f"{number(r.gflops, '10.1f')} {number(r.ratio, '7.3f')} {number(r.sgemm_ratio, '7.2f')} "
        f"{number(r.error_ratio, '9.3f')} "
        f"{number(r.relative_error, '9.1e')}  {r.note}"
    )


HEADER = (
    f"{'kernel':<40} {'shape':<20} {'dtype':<8} {'ms':>10} {'GFLOP/s':>10} {'ratio':>7} {'xSGEMM':>7} {'err.ratio':>9} "
    f"{'rel.err':>9}"
)


def print_rows(rows: list[Result]) -> None:
    for r in rows:
        print(format_row(r), flush=True)


def draw_panels(path: Path, title: str, dtypes: list[str], height: float, panel: Callable[[Any, str], None]) -> bool:
    """One panel of GFLOP/s per dtype, side by side, each drawn by `panel(axis, dtype)`, saved to `path`; False
    when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), height), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        panel(axis, dtype)
        axis.set_ylabel("GFLOP/s")
        axis.set_title(dtype)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write_plot(results: list[Result], meta: dict[str, Any], path: Path) -> bool:
    """GFLOP/s against the side of the square products, one panel per dtype, one line per kernel (per instance
    when every instance was timed), cuBLAS dashed; False when matplotlib is absent."""

    def line(r: Result) -> str:
        # a tensor-core or library row's config is how its operands came (B^T, e4m3), a line of its own; an FMA
        # kernel's is its instance
        separate = bool(r.config) and (meta["configs"] == "all" or r.kernel not in KERNELS)
        return label(f"{r.kernel}/{r.config}" if separate else r.kernel, r)

    def panel(axis: Any, dtype: str) -> None:
        square = [
            r
            for r in results
            if r.dtype == dtype and r.m == r.n == r.k and (r.m, r.n, r.k) not in ODD_SHAPES and r.gflops is not None
        ]
        for name in dict.fromkeys(line(r) for r in square):
            points = sorted((r.m, r.gflops) for r in square if line(r) == name)
            style = {"linestyle": "--", "color": "black"} if name == CUBLAS else {"linestyle": "-"}
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, **style)
        axis.set_xscale("log", base=2)
        if any(r.precision != Precision.FP32 for r in square):
            axis.set_yscale("log")  # the tensor cores' rates are 10-20x the FMA lanes'
        axis.set_xlabel("m = n = k")
        axis.grid(True, alpha=0.3)

    dtypes = sorted({r.dtype for r in results}, key=BENCH_DTYPES.index)
    title = f"matmul kernels vs cuBLAS: {meta['device']}, {meta['date']}"
    return draw_panels(path, title, dtypes, 5, panel)


def label(name: str, r: Result) -> str:
    """A line's or point's name: the kernel's, with the precision when it is not fp32 (tensor cores, other roofs)."""
    return name if r.precision == Precision.FP32 else f"{name} {r.precision}"


def intensity(r: Result) -> float:
    """FLOPs per byte of the global-memory requests of the run's instance (cuBLAS: A, B read and C written once)."""
    config = next((c for c in KERNELS[r.kernel].configs if c.label == r.config), None) if r.kernel in KERNELS else None
    # the libraries' and the tensor-core kernels' traffic: A, B read and C written once
    elements = minimum_global_elements(r.m, r.n, r.k) if config is None else config.global_elements(r.m, r.n, r.k)
    line = roofline(elements, (r.m, r.n, r.k), np.dtype(r.dtype), 1, r.ms or 0.0, DevicePeaks())
    return line.flops / line.global_bytes


def write_roofline_plot(results: list[Result], meta: dict[str, Any], path: Path) -> bool:
    """Achieved GFLOP/s against arithmetic intensity on log-log axes, one panel per dtype, one point per kernel and
    shape, under the compute roof (the FMA lanes' peak) and the memory roof (DRAM bandwidth x intensity) where the
    JSON has them; False when matplotlib is absent or no float row was timed (int8 has no roof here)."""
    timed = [r for r in results if r.gflops is not None and r.dtype in DTYPES]  # the FMA lanes' roofs: floats'

    def panel(axis: Any, dtype: str) -> None:
        points = [(label(r.kernel, r), intensity(r), r.gflops) for r in timed if r.dtype == dtype]
        for name in dict.fromkeys(kernel for kernel, _, _ in points):
            mine = [(x, y) for kernel, x, y in points if kernel == name]
            marker = "*" if name == CUBLAS else "o"
            axis.scatter([x for x, _ in mine], [y for _, y in mine], marker=marker, label=name, alpha=0.8)
        peak, bandwidth = meta.get("peak_gflops", {}).get(dtype), meta.get("dram_gbps")
        xs = [x for _, x, _ in points]
        span = np.geomspace(min(xs) / 2, max(xs) * 2, 200)
        if bandwidth:
            memory_roof = bandwidth * span if peak is None else np.minimum(bandwidth * span, peak)
            axis.plot(span, memory_roof, color="black", label=f"DRAM {bandwidth / 1e3:.2f} TB/s x intensity")
        if peak:
            axis.axhline(peak, color="black", linestyle="--", label=f"FMA peak {peak / 1e3:.1f} TFLOP/s")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("arithmetic intensity, FLOP per byte requested from global memory")
        axis.grid(True, which="both", alpha=0.3)

    dtypes = sorted({r.dtype for r in timed}, key=DTYPES.index)
    return bool(dtypes) and draw_panels(path, f"roofline: {meta['device']}, {meta['date']}", dtypes, 5.5, panel)


def roofline_path(path: Path) -> Path:
    """Where the roofline PNG of a JSON (or of its GFLOP/s PNG) goes: beside it, named ..._roofline.png."""
    return path.with_name(f"{path.stem}_roofline.png")


def replot(path: Path) -> int:
    """Draw the PNGs again from a JSON this script wrote, next to it."""
    document = json.loads(path.read_text(encoding="utf-8"))
    # JSONs written before the per-element bound carry a relative Frobenius error, which no plot draws
    results = [
        Result(**{key: value for key, value in row.items() if key != "rel_error"}) for row in document["results"]
    ]
    meta = document["meta"]
    if not write_plot(results, meta, path.with_suffix(".png")):
        print("matplotlib is not installed", file=sys.stderr)
        return 1
    write_roofline_plot(results, meta, roofline_path(path))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help=f"comma-separated (default: all registered); {', '.join(KERNEL_NAMES)} run on an H100 or H200: "
        f"{MMA_SYNC} and {WGMMA} in the --precisions, {DMMA} in float64",
    )
    parser.add_argument("--sizes", default=",".join(map(str, SQUARE_SIZES)), help="square sides, comma-separated")
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help=f"float32, float64, {INT8} (exact, into int32): comma-separated"
    )
    parser.add_argument("--no-odd", action="store_true", help="leave out the odd shapes")
    parser.add_argument(
        "--configs",
        choices=("chosen", "all"),
        default="chosen",
        help="the instance the registry picks, or every instance",
    )
    parser.add_argument(
        "--precisions",
        default="",
        help="float32 only: cuBLAS (and wgmma) also in these modes, comma-separated, of "
        f"{[str(p) for p in TENSOR_CORE_PRECISIONS]}",
    )
    parser.add_argument(
        "--stack",
        type=int,
        default=0,
        metavar="B",
        help="time stacks of B products of each size in one launch (cuBLAS, torch.bmm, the FMA kernels that take "
        "stacks; float32 and float64)",
    )
    parser.add_argument("--check-only", action="store_true", help="check against the reference, time nothing")
    parser.add_argument("--include-slow", action="store_true", help="time the teaching kernels at every size")
    parser.add_argument("--repeats", type=int, default=10, help="timed launches per measurement (median; >= 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the PNG of a JSON written before")
    parser.add_argument("--out", type=Path, default=Path("docs/bench"), help="directory for the JSON and PNG")
    args = parser.parse_args(argv)
    if args.replot is not None and not args.replot.is_file():
        parser.error(f"--replot: no file {args.replot}")
    args.kernels = [name for name in args.kernels.split(",") if name]
    unknown = [name for name in args.kernels if name not in KERNELS and name not in KERNEL_NAMES]
    if unknown:
        parser.error(f"unknown kernels {unknown}; registered: {list(KERNELS)}")
    args.precisions = [p for p in args.precisions.split(",") if p and p != Precision.FP32]
    if any(p not in TENSOR_CORE_PRECISIONS for p in args.precisions):
        parser.error(f"--precisions must be among {[str(p) for p in TENSOR_CORE_PRECISIONS]} (int8: --dtypes int8)")
    args.precisions = [Precision(p) for p in args.precisions]
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in BENCH_DTYPES for d in args.dtypes):
        parser.error(f"dtypes must be among {list(BENCH_DTYPES)}")
    if args.stack and INT8 in args.dtypes:
        parser.error("--stack times float32 and float64 stacks")
    if args.repeats < 10:
        parser.error("--repeats must be at least 10: the median of fewer is noise")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    started = time.perf_counter()
    print(HEADER, flush=True)
    results, meta = run_sweep(args)
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    meta["configs"] = args.configs
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench_kernels.json"
    json_path.write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n", encoding="utf-8"
    )
    drawn = []
    if not args.check_only and write_plot(results, meta, json_path.with_suffix(".png")):
        drawn.append(json_path.with_suffix(".png").name)
    if not args.check_only and write_roofline_plot(results, meta, roofline_path(json_path)):
        drawn.append(roofline_path(json_path).name)
    summary = f"\n{meta['device']}, {meta['date']}, {meta['wall_s']} s; wrote {json_path}" + (
        f", {' and '.join(drawn)}" if drawn else " (no PNG: nothing was timed, or matplotlib is not installed)"
    )
    print(summary)
    print(HEADER)
    print_rows([r for r in results if (r.m, r.n, r.k) in HEADLINE_SHAPES])
    wrong = sum(r.note == "WRONG" for r in results)
    if wrong:
        print(f"{wrong} kernel run(s) gave wrong results", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
