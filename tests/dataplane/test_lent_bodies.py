"""Bodies read into the HTTP worker's arena (`EngineClient.lend`): operands that lie there in the working dtype go to
a real engine process (CPU backend) where they are, without the staging copy, under concurrency with scarce shared
memory, every product checked; a cancelled product keeps its body's bytes until the engine has let go of them."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from app.config import Settings
from app.dataplane import engine_client
from app.dataplane.engine_client import EngineClient
from app.errors import DeviceLost, InvalidMatrix
from numerics.precision import Precision
from numerics.reference import assert_close_to_reference
from tests.fakes import multiply, record_staging, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
MIB = 1 << 20
SIDE = 256
"""Operands of 256 KiB (float32): a body of two is 512 KiB, and a 4 MiB arena lends at most four at once."""


@pytest.fixture
def settings(request: pytest.FixtureRequest) -> Settings:
    window_us = getattr(request, "param", 0)
    return Settings(backend="cpu", batching=True, max_batch_size=2, max_queue_delay_us=window_us, slab_bytes=4 * MIB)


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    return record_staging(monkeypatch)


def _body(engine: EngineClient, seed: int, data_at: int = 0) -> tuple[Any, np.ndarray, np.ndarray]:
    """What a route holds after reading a body of two float32 operands: the lent memory (None when the arena lent
    none) and the operands decoded from it, as views of it."""
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((SIDE, SIDE), dtype=np.float32) for _ in range(2))
    lent = engine.lend(data_at + a.nbytes + b.nbytes, data_at=data_at)
    if lent is None:
        return None, a, b
    memory = lent.memory[data_at:]
    views = memory[: a.nbytes].view(np.float32).reshape(a.shape), memory[a.nbytes :].view(np.float32).reshape(b.shape)
    for view, operand in zip(views, (a, b), strict=True):
        view[:] = operand
    return lent, *views


async def _product(engine: EngineClient, seed: int, data_at: int) -> bool:
    """One product as a route runs it: whether its body was lent; its answer checked."""
    lent, a, b = _body(engine, seed, data_at)
    try:
        outcome = await multiply(engine, a, b, np.dtype(np.float32), "auto", None, timeout_s=30)
        try:
            assert_close_to_reference(outcome.c, a.astype(np.float64), b, np.dtype(np.float32))
        finally:
            outcome.release()
    finally:
        if lent is not None:
            lent.release()
    return lent is not None


async def test_operands_in_a_lent_body_are_read_where_they_lie_and_every_product_is_its_own(
    engine: EngineClient, staged: list[str]
) -> None:
    """48 products at once on a 4 MiB arena: bodies are lent while there is room and no one waits, the others are
    copied into slabs; products whose bodies hold memory go first; every answer is its own."""
    data_ats = [0, 1, 37, 255]  # where the binary data begins after a v2 JSON header: placed aligned all the same
    lent = await asyncio.gather(*(_product(engine, seed, data_ats[seed % 4]) for seed in range(48)))
    assert any(lent) and not all(lent)
    assert len(staged) == 2 * lent.count(False)  # a and b of each body that was not lent, none of those that were
    await until(lambda: engine.arena.used_bytes == 0)
    assert engine.arena.lent_bytes == 0


async def test_an_operand_in_a_lent_body_is_copied_where_the_engine_could_not_read_it_as_it_is(
    engine: EngineClient, staged: list[str]
) -> None:
    """Another dtype or byte order, or a view that is not aligned: converted into the slab as any operand."""
    lent = engine.lend(MIB)
    assert lent is not None
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((64, 32)), rng.standard_normal((32, 48))
    float64_a = lent.memory[: a.nbytes].view(np.float64).reshape(a.shape)
    big_endian_b = lent.memory[a.nbytes : a.nbytes + b.nbytes // 2].view(">f4").reshape(b.shape)
    misaligned_a = lent.memory[1 : 1 + a.nbytes // 2].view(np.float32).reshape(a.shape)
    aligned_b = lent.memory[a.nbytes : a.nbytes + b.nbytes // 2].view(np.float32).reshape(b.shape)
    float64_a[:], big_endian_b[:] = a, b
    for x, y, copied in ((float64_a, big_endian_b, ["a", "b"]), (misaligned_a, aligned_b, ["a"])):
        y[:] = b
        x[:] = a
        staged.clear()
        outcome = await multiply(engine, x, y, np.dtype(np.float32), "auto", None, timeout_s=30)
        assert staged == copied
        assert_close_to_reference(outcome.c, x.astype(np.float64), y.astype(np.float64), np.dtype(np.float32))
        outcome.release()
    lent.release()
    del lent, float64_a, big_endian_b, misaligned_a, aligned_b, x, y, outcome  # what views the slabs
    await until(lambda: engine.arena.used_bytes == 0)


@pytest.mark.parametrize("settings", [1_000_000], indirect=True)  # a product waits a second for company
async def test_a_cancelled_product_keeps_its_lent_body_until_the_engine_lets_go(engine: EngineClient) -> None:
    """The route gives its body back as soon as its request is cancelled; the engine may still read the operands
    there: the bytes come back only with the engine's reply to the cancel (held back here by stopping the engine
    process)."""
    lent, a, b = _body(engine, seed=1)
    assert lent is not None
    waiting = asyncio.create_task(multiply(engine, a, b, np.dtype(np.float32), "auto", None, timeout_s=30))
    await until(lambda: engine.links[0].in_flight == 1)
    engine_pid = engine.links[0].welcome.engine_pid  # type: ignore[union-attr]
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        lent.release()
        del lent, a, b, waiting  # the route's views of the body
        await asyncio.sleep(0.1)
        assert engine.arena.lent_bytes > 0 and engine.links[0].in_flight == 1
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    await until(lambda: engine.arena.used_bytes == 0, guard_s=10)
    assert engine.arena.lent_bytes == 0


@pytest.mark.usefixtures("without_garbage_collection")
async def test_an_operand_read_where_it_lies_is_checked_off_the_loop_only_where_the_check_reads_it(
    engine: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the inline size, an fp16 product's range check reads every element of an operand, in a thread, and
    refuses one beyond fp16's range by name; a float32 product's check reads nothing and stays on the loop. The
    refused body's memory comes back once its last view goes, with no garbage collection."""
    checked_in: list[tuple[str, int]] = []
    check = engine_client.check_in_format

    def spied(x: np.ndarray, name: str, precision: Precision) -> None:
        checked_in.append((precision, threading.get_ident()))
        check(x, name, precision)

    monkeypatch.setattr(engine_client, "check_in_format", spied)
    engine.inline_bytes = 64 << 10  # each operand is 256 KiB
    lent, a, b = _body(engine, seed=3)
    assert lent is not None
    outcome = await multiply(engine, a, b, np.dtype(np.float32), timeout_s=30)
    assert_close_to_reference(outcome.c, a.astype(np.float64), b, np.dtype(np.float32))
    outcome.release()
    b[7, 9] = 1e5  # finite, and infinite once rounded to fp16
    with pytest.raises(InvalidMatrix, match=r"\bb\b.*out of range for precision fp16") as refused:
        await multiply(engine, a, b, np.dtype(np.float32), timeout_s=30, precision=Precision.FP16)
    lent.release()
    loop = threading.get_ident()
    assert [(precision, thread == loop) for precision, thread in checked_in] == [
        (Precision.FP32, True),
        (Precision.FP32, True),
        (Precision.FP16, False),
        (Precision.FP16, False),
    ]
    del lent, a, b, outcome, refused  # what views the arena, the refusal's frames included
    await until(lambda: engine.arena.used_bytes == 0)


@pytest.mark.usefixtures("without_garbage_collection")
@pytest.mark.parametrize("settings", [1_000_000], indirect=True)  # a product waits a second for company
async def test_a_product_lost_with_its_engine_gives_its_lent_body_back(engine: EngineClient) -> None:
    """The engine process dies while it holds a product whose operands lie in a lent body: the product fails, and
    the body's bytes come back once the route has let go of it, by its references alone."""
    lent, a, b = _body(engine, seed=4)
    assert lent is not None
    waiting = asyncio.create_task(multiply(engine, a, b, np.dtype(np.float32), "auto", None, timeout_s=30))
    await until(lambda: engine.links[0].in_flight == 1)
    os.kill(engine.links[0].welcome.engine_pid, signal.SIGKILL)  # type: ignore[union-attr]
    with pytest.raises(DeviceLost):
        await waiting
    lent.release()
    del lent, a, b, waiting  # the route's views of the body, and the task that holds the error
    await until(lambda: engine.arena.used_bytes == 0)
    assert engine.arena.lent_bytes == 0
