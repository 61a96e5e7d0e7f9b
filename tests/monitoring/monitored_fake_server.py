"""The fake-engine server of tests/reliability with every panel's series moving: the engine
reports prefix-cache hits, a preemption now and then and speculative drafts (the plain fake
engine reports none), and the front end reads a GPU's memory from a stand-in for NVML. The app,
its /metrics and /dashboard are the real ones.

    python monitored_fake_server.py --port P [server flags] [--step-delay S] [--die-once-file F]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))

from fake_engine import FakeEngine  # noqa: E402

from pagoda.server.cli import add_server_flags, serve  # noqa: E402

GiB = 2**30
DIE_MARK = "DIE-ONCE"


class MonitoredFakeEngine(FakeEngine):
    """FakeEngine whose statistics also count prefix-cache hits (half of each prompt),
    a preemption every 40 steps and 3 drafted tokens per running request (2 accepted). (The
    front end's output processor counts aborted requests as finished with reason "abort".)"""

    steps = 0

    def __init__(self, die_once_file: str | None = None, **kw) -> None:  # noqa: ANN003
        super().__init__(**kw)
        self.die_once_file = die_once_file

    def add_requests(self, requests) -> None:  # noqa: ANN001
        # The engine core process dies (as the OOM killer would end it) at the first prompt
        # holding DIE_MARK, so that the server restarts it once: engine_restarts_total moves.
        text = bytes(t for t in requests[0].prompt_token_ids if t < 256).decode()
        if DIE_MARK in text and self.die_once_file and not os.path.exists(self.die_once_file):
            open(self.die_once_file, "w").close()
            os._exit(3)
        super().add_requests(requests)

    def step(self):  # noqa: ANN201
        outputs = super().step()
        self.steps += 1
        s, it = self.last_scheduler_stats, self.last_iteration_stats
        s.prefix_cache_hits = s.prefix_cache_queries // 2
        s.num_preemptions = int(self.steps % 40 == 0 and bool(self.running))
        it.num_drafts = s.num_running_reqs
        it.num_draft_tokens, it.num_accepted_tokens = 3 * it.num_drafts, 2 * it.num_drafts
        return outputs


def fake_gpu_memory() -> list[tuple[int, int, int]]:
    return [(0, 60 * GiB, 80 * GiB)]


def main() -> None:
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.metrics import gpu

    gpu.read_gpu_memory = fake_gpu_memory
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    parser.add_argument("--step-delay", type=float, default=0.005)
    parser.add_argument("--die-once-file", default=None)
    args = parser.parse_args()
    factory = functools.partial(MonitoredFakeEngine, die_once_file=args.die_once_file,
                                max_model_len=args.max_model_len or 256,
                                max_num_seqs=args.max_num_seqs, step_delay=args.step_delay)  # fmt: skip
    engine = AsyncLLM(engine_factory=factory, max_engine_restarts=args.max_engine_restarts)
    serve(engine, args)


if __name__ == "__main__":
    main()
