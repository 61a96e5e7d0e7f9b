"""The W4A16 GEMV ring's protocol (`w4a16_gemv.cu`, BULK with the producer warp, PERSISTENT or
not), modelled in Python and run under random interleavings of its warps: the producer fills
chunk q into stage q % STAGES once the stage's use before has been released by all WARPS
consumers (`empty`), the consumers wait for a chunk to land (`full`) at their first step of
it and release it at their last, and with PERSISTENT a CTA's chunks are counted on across its
tiles and the warps with no step of a last chunk cut short release it too, after it lands.

The GPU tests (`test_w4a16_gemv.py`) check the kernel's sums; this checks, for every chunk size,
stage count, step count and tile share, what a wrong rule would only show as a hang or as a
stage overwritten while read: no deadlock, every chunk released by exactly WARPS arrivals
before its stage is refilled, no arrival counted towards another chunk's release, no wait on a
barrier two phases ahead (its parity would be ambiguous). Keep it in step with the kernel's
release rules."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest


class _Ring:
    def __init__(self, stages: int) -> None:
        self.full_phases = [0] * stages  # completed phases of each stage's `full` barrier
        self.empty_arrivals = [0] * stages  # arrivals on each stage's `empty` barrier, in all
        self.holds = [-1] * stages  # the chunk that has landed in each stage
        self.released: dict[int, int] = {}  # chunk -> consumer warps that released it


def _simulate(
    steps: int, chunk: int, warps: int, stages: int, tiles: int, seed: int,
    wait_to_release: bool = True,
) -> None:  # fmt: skip
    """One CTA taking `tiles` tiles of `steps` K steps each; `wait_to_release` False: the warps
    with no step of a last chunk release it without waiting for it to land."""
    chunks = -(-steps // chunk)
    ring = _Ring(stages)

    def wait_landed(q: int) -> Iterator[None]:
        st = q % stages
        while ring.full_phases[st] < q // stages + 1:
            yield
        assert ring.full_phases[st] == q // stages + 1, "a wait on a barrier two phases ahead"

    def release(q: int) -> None:
        ring.empty_arrivals[q % stages] += 1
        ring.released[q] = ring.released.get(q, 0) + 1
        assert ring.released[q] <= warps, f"chunk {q} released {ring.released[q]} times"

    def producer() -> Iterator[None]:
        for q in range(tiles * chunks):
            st = q % stages
            if q >= stages:  # the stage's uses before released: (q // stages) * warps arrivals
                while ring.empty_arrivals[st] < (q // stages) * warps:
                    yield
                assert ring.released.get(q - stages) == warps, f"chunk {q - stages} in use"
            yield  # the copy in flight
            ring.holds[st] = q
            ring.full_phases[st] += 1

    def consumer(w: int) -> Iterator[None]:
        for q0 in range(0, tiles * chunks, chunks):
            for s in range(w, steps, warps):
                q = q0 + s // chunk
                if s % chunk < warps:  # this warp's first step of the chunk
                    yield from wait_landed(q)
                assert ring.holds[q % stages] == q, f"chunk {q} read from another's stage"
                yield  # the step's shared loads
                assert ring.holds[q % stages] == q, f"chunk {q} overwritten while read"
                if s % chunk >= chunk - warps or s + warps >= steps:  # its last step of it
                    release(q)
            last_steps = steps - (chunks - 1) * chunk
            if last_steps < warps and w >= last_steps:  # no step of the last chunk
                q = q0 + chunks - 1
                if wait_to_release:
                    yield from wait_landed(q)
                release(q)
            yield  # the tile's sums stored

    rnd = random.Random(seed)
    live = [producer()] + [consumer(w) for w in range(warps)]
    for _ in range(10**6):
        if not live:
            break
        t = rnd.choice(live)
        try:
            next(t)
        except StopIteration:
            live.remove(t)
    else:
        raise AssertionError("deadlock")
    assert ring.released == {q: warps for q in range(tiles * chunks)}


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("chunk_steps", [1, 2, 4])  # K steps a warp and chunk
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("tiles", [1, 3])  # 1: a CTA a tile (PERSISTENT off)
def test_ring_chunks_are_released_once_each_and_never_overwritten_while_read(
    warps: int, chunk_steps: int, stages: int, tiles: int
) -> None:
    chunk = warps * chunk_steps
    # K steps: fewer than the warps, a last chunk cut short, whole chunks, Llama's 32 and 112
    for steps in sorted({1, 3, warps - 1, warps + 1, chunk, chunk + 1, 2 * chunk - 1, 32, 112}):
        for seed in range(4):
            _simulate(steps, chunk, warps, stages, tiles, seed)


def test_the_model_catches_a_release_before_the_chunk_lands() -> None:
    # Warps with no step of a last chunk releasing it at once (the kernel's first rule): their
    # arrival can count towards the stage's use before, a tile earlier, which would let the
    # producer refill a stage still being read.
    failures = 0
    for seed in range(20):
        try:
            _simulate(3, 4, 4, 1, 3, seed, wait_to_release=False)
        except AssertionError:
            failures += 1
    assert failures
