"""The preprocessing workers (`pagoda.server.preprocess`) with a stand-in tokenizer: a client
that gives up on a long prompt must not leave its worker to the next request."""

from __future__ import annotations

import asyncio
import time

from pagoda.server.preprocess import INLINE_CHARS, Preprocessor


class SlowTokenizer:
    """Encodes a text as [its first character, its length]; texts starting with "slow" take
    `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("slow"):
            time.sleep(self.delay)
        return [ord(text[0]), len(text)]


def test_a_cancelled_job_leaves_its_worker_to_no_one() -> None:
    long_a = "slow" + "a" * INLINE_CHARS
    long_b = "b" * (INLINE_CHARS + 7)

    async def run() -> tuple[list[int], list[int], float]:
        pre = Preprocessor(SlowTokenizer(delay=3.0), num_workers=1, timeout_s=20)
        try:
            await pre.encode("w" * (INLINE_CHARS + 1))  # the worker is up
            first = asyncio.create_task(pre.encode(long_a))
            await asyncio.sleep(0.3)  # the worker is busy with it
            first.cancel()  # as when its client disconnects
            t0 = time.monotonic()
            b = await asyncio.wait_for(pre.encode(long_b), 30)
            waited = time.monotonic() - t0
            again = await asyncio.wait_for(pre.encode(long_b + "b"), 30)
            return b, again, waited
        finally:
            pre.close()

    b, again, waited = asyncio.run(run())
    assert b == [ord("b"), len(long_b)]  # its own tokens, not the cancelled job's
    assert again == [ord("b"), len(long_b) + 1]
    assert waited < 2.5  # a fresh worker, not the end of the cancelled job (3 s)
