"""The defaults that make the fast path: HTTP workers from the host's CPUs, shared memory from its memory, batching on
without a queue delay; and an empty variable read as an unset one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from app import host
from app.config import (
    MAX_DEFAULT_HTTP_WORKERS,
    MAX_DEFAULT_SLAB_BYTES,
    MIN_DEFAULT_SLAB_BYTES,
    Settings,
    default_http_workers,
    default_slab_bytes,
)
from app.dataplane.supervisor import engine_environment
from app.engine import BatchPolicy, DeviceWorker, EngineState, LocalEngine
from tests.fakes import GATE_TIMEOUT_S, SteeredBackend, multiply, until

MIB, GIB = 1 << 20, 1 << 30
Host = Callable[[int, int], None]


@pytest.fixture(autouse=True)
def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the variables these tests read is set, whatever this process's environment holds."""
    for name in ("HTTP_WORKERS", "SLAB_BYTES", "BATCHING", "MAX_QUEUE_DELAY_US", "DEVICES", "API_KEYS"):
        monkeypatch.delenv(f"MATMUL_{name}", raising=False)
    monkeypatch.delenv("MATMUL_KERNEL_CACHE_DIR", raising=False)


@pytest.fixture
def host_of(monkeypatch: pytest.MonkeyPatch) -> Host:
    """Makes the usable CPUs and memory (bytes) of the host what a test says."""

    def set_host(cpus: int, memory: int) -> None:
        monkeypatch.setattr(host, "usable_cpus", lambda: cpus)
        monkeypatch.setattr(host, "usable_memory_bytes", lambda: memory)

    return set_host


def settings() -> Settings:
    return Settings(_env_file=None)


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (17, 8), (64, 8)])
def test_the_default_http_workers_are_half_the_cpus_from_one_to_the_cap(cpus: int, workers: int) -> None:
    assert default_http_workers(cpus, 128 * GIB) == workers


@pytest.mark.parametrize(
    ("memory", "workers"), [(512 * MIB, 1), (GIB, 1), (2 * GIB, 2), (4 * GIB + MIB, 4), (8 * GIB, 8)]
)
def test_the_default_http_workers_fit_their_shared_memory_in_a_quarter_of_the_memory(memory: int, workers: int) -> None:
    """A 4 GiB container on a 64-CPU node: 4 workers of 256 MiB, not 8 whose floor would pin half its memory."""
    assert default_http_workers(64, memory) == workers
    assert workers == 1 or workers * MIN_DEFAULT_SLAB_BYTES <= memory // 4


def test_the_cap_is_the_count_measured() -> None:
    assert MAX_DEFAULT_HTTP_WORKERS == 8, "the count measured on the 16-core H100 host (docs/throughput.md)"


@pytest.mark.parametrize(
    ("workers", "memory", "slab"),
    [
        (8, 4 * GIB, MIN_DEFAULT_SLAB_BYTES),  # 128 MiB each: the floor, 256 MiB
        (1, 1 * GIB, MIN_DEFAULT_SLAB_BYTES),  # a quarter is 256 MiB
        (1, 2 * GIB, 512 * MIB),
        (2, 3 * GIB, 384 * MIB),
        (8, 20 * GIB, 640 * MIB),
        (3, 5 * GIB + 12345, 426 * MIB),  # 426.7 MiB, rounded down to a MiB
        (8, 32 * GIB, GIB),
        (8, 1024 * GIB, MAX_DEFAULT_SLAB_BYTES),  # 32 GiB each: the cap, 1 GiB
    ],
)
def test_the_default_shared_memory_is_a_quarter_of_the_memory_over_the_workers(
    workers: int, memory: int, slab: int
) -> None:
    assert default_slab_bytes(workers, memory) == slab


@pytest.mark.parametrize(
    ("cpus", "memory", "workers", "slab"),
    [
        (16, 64 * GIB, 8, GIB),
        (16, 8 * GIB, 8, 256 * MIB),
        (2, 8 * GIB, 1, GIB),
        (6, 6 * GIB, 3, 512 * MIB),
        (64, 4 * GIB, 4, 256 * MIB),
    ],
)
def test_with_no_settings_the_service_derives_workers_and_shared_memory_from_the_host(
    host_of: Host, cpus: int, memory: int, workers: int, slab: int
) -> None:
    host_of(cpus, memory)
    derived = settings()
    assert (derived.http_workers, derived.slab_bytes) == (workers, slab)
    assert {"http_workers", "slab_bytes"}.isdisjoint(derived.model_fields_set), "defaults, not given"


def test_the_shared_memory_is_derived_for_the_workers_given(host_of: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    host_of(16, 8 * GIB)
    monkeypatch.setenv("MATMUL_HTTP_WORKERS", "2")
    assert (settings().http_workers, settings().slab_bytes) == (2, GIB)
    monkeypatch.setenv("MATMUL_SLAB_BYTES", str(300 * MIB))
    assert settings().slab_bytes == 300 * MIB, "a given size is kept"
    monkeypatch.setenv("MATMUL_SLAB_BYTES", "1000")
    with pytest.raises(ValidationError, match="slab_bytes"):
        settings()


def test_an_empty_variable_is_the_default(host_of: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    host_of(16, 64 * GIB)
    defaults = settings()
    for name in ("HTTP_WORKERS", "SLAB_BYTES", "BATCHING", "MAX_QUEUE_DELAY_US", "DEVICES", "API_KEYS"):
        monkeypatch.setenv(f"MATMUL_{name}", "")
    monkeypatch.setenv("MATMUL_KERNEL_CACHE_DIR", "")
    assert settings() == defaults and settings().http_workers == 8 and settings().kernel_cache_dir is None


def test_the_kernel_cache_reaches_the_engines_only_where_it_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MATMUL_KERNEL_CACHE_DIR", "/srv/kernels")
    assert settings().kernel_cache_dir == Path("/srv/kernels")
    assert engine_environment(settings())["MATMUL_KERNEL_CACHE_DIR"] == "/srv/kernels"
    unset = engine_environment(Settings(_env_file=None, kernel_cache_dir=None))
    assert "MATMUL_KERNEL_CACHE_DIR" not in unset, "the engine takes its own default, not the text None"


def test_the_lists_still_split() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("MATMUL_DEVICES", "0, 1,")
        monkeypatch.setenv("MATMUL_API_KEYS", "k1,k2")
        given = settings()
    assert given.devices == [0, 1] and [key.get_secret_value() for key in given.api_keys] == ["k1", "k2"]


@pytest.mark.parametrize(
    ("devices", "said"),
    [
        ("-1,0", r"devices\.0\n  Input should be greater than or equal to 0"),
        ("1,0,1,2,0", r"devices\n  Value error, a device may be named once only; repeated: 0, 1"),
    ],
)
def test_the_devices_are_ordinals_each_named_once(monkeypatch: pytest.MonkeyPatch, devices: str, said: str) -> None:
    """Two engine processes on one device would share it (and one socket), not double it."""
    monkeypatch.setenv("MATMUL_DEVICES", devices)
    with pytest.raises(ValidationError, match=said):
        settings()


@pytest.mark.parametrize("silence", ["0.3", "0", "-1"])
def test_an_engine_silence_shorter_than_two_of_its_status_periods_is_refused(
    monkeypatch: pytest.MonkeyPatch, silence: str
) -> None:
    """The engine sends its status every 0.5 s: under 1 s of silence, a ready engine would be taken for hung between
    two statuses (0.3 s: 8 of 20 probes of /readyz answered 503)."""
    monkeypatch.setenv("MATMUL_ENGINE_SILENCE_S", silence)
    with pytest.raises(ValidationError, match=r"engine_silence_s\n  Input should be greater than or equal to 1"):
        settings()


def test_batching_is_on_without_a_queue_delay_by_default() -> None:
    defaults = settings()
    assert defaults.batching is True and defaults.max_queue_delay_us == 0


@pytest.mark.anyio
async def test_by_default_a_lone_product_is_launched_at_once_and_products_queued_meanwhile_share_a_launch() -> None:
    """The engine's batching as the defaults set it: the first product, alone, is launched without waiting for
    company (a window above 0 would hold it until one came); the two that queue while it runs go in one launch."""
    defaults = settings()
    policy = BatchPolicy(max_size=defaults.max_batch_size, max_delay_s=defaults.max_queue_delay_us / 1e6)
    backend = SteeredBackend()
    engine = LocalEngine(DeviceWorker(backend, queue_size=8, batching=policy if defaults.batching else None))
    engine.start()
    try:
        await until(lambda: engine.state is EngineState.READY)
        backend.gate.clear()
        f64 = np.dtype(np.float64)
        products = [asyncio.create_task(multiply(engine, np.ones((2, 1)), np.ones((1, 1)), f64, "numpy"))]
        assert await asyncio.to_thread(backend.entered.acquire, True, GATE_TIMEOUT_S), "it waited for company"
        products += [
            asyncio.create_task(multiply(engine, np.full((2, 1), x), np.ones((1, 1)), f64, "numpy")) for x in (2.0, 3.0)
        ]
        await until(lambda: engine.queue_depth == 2)
        backend.gate.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*products), GATE_TIMEOUT_S)
    finally:
        backend.gate.set()
        await engine.stop()
    assert [s.products for s in backend.submitted] == [1, 2]
    assert [(o.c[0, 0], o.batch_size) for o in outcomes] == [(1.0, 1), (2.0, 2), (3.0, 2)]
