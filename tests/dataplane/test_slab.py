"""The HTTP worker's shared-memory arena: slabs handed out first-fit in the order asked, waits bounded by the
deadline, nothing lost when a waiter gives up."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from app.dataplane.slab import ALIGNMENT, Arena, Slab, aligned
from app.errors import Overloaded, PayloadTooLarge
from tests.fakes import until

pytestmark = pytest.mark.anyio
MIB = 1 << 20


@pytest.fixture
def arena() -> Arena:
    return Arena(4 * MIB)


async def _queued(arena: Arena, nbytes: int, timeout_s: float = 30, holding: int = 0) -> asyncio.Task[Slab]:
    """`arena.reserve` as a task, once it waits in the arena's queue."""
    ahead = arena.waiting
    reserving = asyncio.create_task(arena.reserve(nbytes, timeout_s=timeout_s, holding=holding))
    await until(lambda: arena.waiting == ahead + 1)
    return reserving


async def _all_given_back(arena: Arena) -> None:
    """A released slab's bytes come back on the event loop, soon after its last view is gone."""
    await until(lambda: arena.used_bytes == 0)


def test_sizes_round_up_to_the_alignment() -> None:
    assert [aligned(n) for n in (0, 1, ALIGNMENT, ALIGNMENT + 1)] == [0, ALIGNMENT, ALIGNMENT, 2 * ALIGNMENT]


async def test_a_slab_places_matrices_back_to_back_aligned_and_views_them_in_the_shared_file(arena: Arena) -> None:
    slab = await arena.reserve(3 * MIB, timeout_s=1)
    a_at, b_at = slab.place((3, 5), np.dtype(np.float32)), slab.place((5, 2), np.dtype(np.float64))
    assert (a_at.offset, b_at.offset) == (slab.offset, slab.offset + ALIGNMENT)
    slab.array(b_at)[:] = 7.0
    in_the_file = os.pread(arena.fd, b_at.nbytes, b_at.offset)  # what another process mapping it sees
    assert np.frombuffer(in_the_file, np.float64).tolist() == [7.0] * 10
    with pytest.raises(ValueError, match="does not fit"):
        slab.place((1024, 1024), np.dtype(np.float64))
    slab.release()
    slab.release()  # once only: the second is nothing
    await _all_given_back(arena)
    with pytest.raises(RuntimeError, match="released"):
        slab.array(a_at)


async def test_more_than_the_whole_arena_is_413_at_once(arena: Arena) -> None:
    with pytest.raises(PayloadTooLarge, match="MATMUL_SLAB_BYTES"):
        await arena.reserve(4 * MIB + 1, timeout_s=10)
    assert (await arena.reserve(4 * MIB, timeout_s=1)).size == 4 * MIB  # exactly the arena fits


async def test_released_neighbours_merge_so_a_large_slab_fits_again(arena: Arena) -> None:
    slabs = [await arena.reserve(MIB, timeout_s=1) for _ in range(4)]
    for i in (1, 3, 0, 2):  # out of order: each release merges with whichever neighbours are free
        slabs[i].release()
    await _all_given_back(arena)
    assert (await arena.reserve(4 * MIB, timeout_s=1)).offset == 0


async def test_a_request_that_finds_no_room_waits_for_a_release(arena: Arena) -> None:
    held = await arena.reserve(3 * MIB, timeout_s=1)
    waiting = await _queued(arena, 2 * MIB)
    assert not waiting.done()
    held.release()
    slab = await waiting
    assert (slab.offset, arena.waiting) == (0, 0)


async def test_no_room_within_the_deadline_is_503_and_the_waiter_leaves(arena: Arena) -> None:
    held = await arena.reserve(4 * MIB, timeout_s=1)
    with pytest.raises(Overloaded, match=r"no shared memory came free .* within 0\.01 s"):
        await arena.reserve(MIB, timeout_s=0.01)
    assert arena.waiting == 0
    held.release()
    await _all_given_back(arena)


async def test_waiters_are_served_in_the_order_they_asked(arena: Arena) -> None:
    held = await arena.reserve(4 * MIB, timeout_s=1)
    big = await _queued(arena, 3 * MIB)
    small = await _queued(arena, MIB)
    held.release()
    first, second = await big, await small
    assert (first.offset, second.offset) == (0, 3 * MIB)


async def test_a_new_request_queues_behind_a_waiter_even_where_it_would_fit(arena: Arena) -> None:
    held = await arena.reserve(3 * MIB, timeout_s=1)
    big = await _queued(arena, 2 * MIB)
    small = await _queued(arena, MIB // 2)  # would fit now, but waits its turn
    held.release()
    assert ((await big).offset, (await small).offset) == (0, 2 * MIB)


async def test_a_cancelled_waiter_leaves_the_queue(arena: Arena) -> None:
    held = await arena.reserve(4 * MIB, timeout_s=1)
    waiting = await _queued(arena, MIB)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert arena.waiting == 0
    held.release()
    await _all_given_back(arena)


def test_the_arena_has_no_name_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    arena = Arena(MIB)
    assert set(os.listdir("/dev/shm")) == before
    assert os.readlink(f"/proc/self/fd/{arena.fd}").startswith("/memfd:")
    arena.close()


async def test_a_released_slab_waits_for_its_last_view_before_anyone_else_gets_its_bytes(arena: Arena) -> None:
    """What a server's transport does with an `.npy` answer it could not send at once: it keeps a memoryview of the
    rest after `send` returned. The slab's bytes go to the next request only once that view is gone."""
    slab = await arena.reserve(4 * MIB, timeout_s=1)
    c = slab.array(slab.place((1024, 1024), np.dtype(np.float32)))
    c[:] = 1.0
    rest_to_send = memoryview(np.ascontiguousarray(c).data).cast("B")[4096:]  # as the transport holds it
    del c
    slab.release()
    waiting = asyncio.create_task(arena.reserve(MIB, timeout_s=30))
    await asyncio.sleep(0.05)
    assert not waiting.done() and arena.used_bytes == 4 * MIB
    assert set(np.frombuffer(rest_to_send, np.float32).tolist()) == {1.0}
    del rest_to_send  # sent
    assert (await waiting).offset == 0


async def test_a_view_dropped_in_another_thread_gives_the_bytes_back_on_the_loop(arena: Arena) -> None:
    """A staging thread that outlives its cancelled request: the bytes come back when it lets go, on the loop."""
    slab = await arena.reserve(MIB, timeout_s=1)
    target = [slab.array(slab.place((256, 256), np.dtype(np.float64)))]
    slab.release()
    await asyncio.sleep(0.01)
    assert arena.used_bytes == MIB

    def write_then_let_go() -> None:
        target.pop()[:] = 2.0

    await asyncio.to_thread(write_then_let_go)
    await _all_given_back(arena)
    assert (await arena.reserve(4 * MIB, timeout_s=1)).offset == 0


async def test_a_slab_dropped_without_release_still_comes_back(arena: Arena) -> None:
    """A request that failed before it could release its slab (the object is garbage): nothing leaks."""
    slab = await arena.reserve(MIB, timeout_s=1)
    del slab
    await _all_given_back(arena)


async def test_a_body_is_lent_memory_only_when_there_is_room_now_and_no_one_waits(arena: Arena) -> None:
    """Body memory is never waited for: no room now, a request waiting, or bodies already holding half the arena,
    and the body is read elsewhere (None)."""
    body = arena.lend(MIB)
    assert body is not None and arena.lent_bytes == MIB
    assert arena.lend(MIB + 1) is None  # bodies would hold more than half of the 4 MiB
    other = arena.lend(MIB)
    assert other is not None and arena.lent_bytes == 2 * MIB
    held = await arena.reserve(2 * MIB, timeout_s=1)
    other.release()
    body.release()
    await _all_given_back_but(arena, 2 * MIB)
    assert arena.lent_bytes == 0
    waiting = await _queued(arena, 3 * MIB)
    assert arena.lend(ALIGNMENT) is None  # room for it, but its bytes may be what the waiter needs
    held.release()
    (await waiting).release()
    await _all_given_back(arena)


async def _all_given_back_but(arena: Arena, held: int) -> None:
    await until(lambda: arena.used_bytes == held)


async def test_while_a_body_is_lent_requests_that_fit_beside_it_are_served_first_fit(arena: Arena) -> None:
    """Holding one slab while waiting for another in the order asked could wait for ever: while a body is lent, the
    requests that fit beside the lent bodies are served whichever fits first, and those that do not wait behind."""
    body = arena.lend(2 * MIB)
    assert body is not None
    fillers = [await arena.reserve(MIB // 2, timeout_s=1), await arena.reserve(3 * MIB // 2, timeout_s=1)]
    plain = await _queued(arena, 3 * MIB)  # needs the body's bytes back
    holder = await _queued(arena, MIB, holding=2 * MIB)
    small = await _queued(arena, MIB // 2)
    fillers.pop(0).release()
    served = await small  # fits first, ahead of the holder and of the request that asked before both
    assert not holder.done() and not plain.done()
    fillers.pop().release()
    (await holder).release()
    served.release()
    await asyncio.sleep(0.01)
    assert not plain.done()  # the body still holds its bytes
    body.release()
    (await plain).release()
    await _all_given_back(arena)
    assert arena.lent_bytes == 0


async def test_a_request_holding_a_body_that_cannot_fit_beside_the_bodies_is_refused_at_once(arena: Arena) -> None:
    body, other = arena.lend(MIB), arena.lend(MIB)
    assert body is not None and other is not None
    with pytest.raises(PayloadTooLarge, match="beside the 1048576 bytes of its body"):
        await arena.reserve(3 * MIB + 1, timeout_s=30, holding=MIB)
    with pytest.raises(Overloaded, match="do not fit beside the 2097152 bytes that request bodies hold"):
        await arena.reserve(5 * MIB // 2, timeout_s=30, holding=MIB)
    assert arena.waiting == 0
    body.release()
    other.release()
    await _all_given_back(arena)


async def test_a_waiter_that_gives_up_lets_those_behind_it_be_served(arena: Arena) -> None:
    held = await arena.reserve(2 * MIB, timeout_s=1)
    first = await _queued(arena, 3 * MIB, timeout_s=0.05)
    behind = asyncio.create_task(arena.reserve(MIB, timeout_s=30))
    with pytest.raises(Overloaded):
        await first
    (await asyncio.wait_for(behind, 5)).release()
    held.release()
    await _all_given_back(arena)


async def test_a_lent_body_viewed_after_its_release_keeps_its_bytes(arena: Arena) -> None:
    """An operand decoded from a lent body outlives the request (a cancelled product the engine still reads): the
    body's bytes come back with its last view."""
    body = arena.lend(MIB)
    assert body is not None
    operand = body.memory(0, MIB).view(np.float32)
    operand[:] = 3.0
    assert arena.offset_of(operand) == body.offset and arena.offset_of(np.ones(4)) is None
    body.release()
    await asyncio.sleep(0.01)
    assert arena.used_bytes == arena.lent_bytes == MIB
    del operand
    await _all_given_back(arena)
    assert arena.lent_bytes == 0


async def test_whoever_watches_the_arena_is_told_every_change_of_the_bytes_in_use(arena: Arena) -> None:
    """What the worker's gauge of its shared memory hears: each slab reserved, lent or given back, as it happens."""
    told: list[int] = []
    arena.on_use = told.append
    slab = await arena.reserve(MIB, timeout_s=1)
    body = arena.lend(ALIGNMENT + 1)
    assert body is not None
    assert told == [MIB, MIB + 2 * ALIGNMENT]
    slab.release()
    body.release()
    await _all_given_back(arena)
    assert told[2:] in ([2 * ALIGNMENT, 0], [MIB, 0])  # in whichever order the two come back
