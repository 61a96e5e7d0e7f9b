"""Time per token of applying structured-outputs constraints with xgrammar, over the embedded
model's tokenizer (SmolLM2, 49,152 tokens): computing the next-token mask
(`fill_next_token_bitmask`) and advancing the matcher past a token (`accept_token`). Ordinary
constraints walk a valid path, a random allowed token at a time (seeded; EOS only when nothing
else is allowed), three times `--tokens` tokens at most; the slow regex
`([^a]{1,50}[^b]{1,50}){1,50}` follows the tokens of a fixed English text: masks for the first
`--slow-tokens` of them (seconds each after a few tokens), then advancing alone through 80.
`--busy N` runs N busy-looping processes meanwhile (a machine shared with other work). These
numbers set the default of PAGODA_GRAMMAR_MASK_BUDGET_MS.

`--engine` measures the engine instead (`pagoda.LLM`'s, offline): the time of each step of a
request decoding 12 greedy tokens alone, then beside a request under the slow regex (stopped
after `--engine-seconds`).

    python benchmarks/grammar_mask_time.py [--tokens 64] [--slow-tokens 8] [--busy 0]
    python benchmarks/grammar_mask_time.py --engine [--engine-seconds 60]
    python benchmarks/grammar_mask_time.py --abandoned 0,1,2,3,4

`--abandoned` measures what fills given up on cost the others (what
PAGODA_GRAMMAR_MAX_ABANDONED bounds): the engine's step times for 4 plain requests while N
fills of the slow regex run on threads of their own.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
from typing import Any

import numpy as np

from pagoda.config import embedded_model_path
from pagoda.sampling_params import StructuredOutputsParams as P
from pagoda.structured_output.backend_xgrammar import XgrammarBackend
from pagoda.tokenizer import get_tokenizer

SLOW_REGEX = "([^a]{1,50}[^b]{1,50}){1,50}"
_PROPS = {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(40)}
CASES = {
    "json schema, 3 properties": P(json={
        "type": "object", "required": ["name", "age", "tags"], "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}}}}),
    "json schema, 40 properties": P(json={
        "type": "object", "properties": _PROPS, "required": list(_PROPS)}),
    "json schema, pattern + enum": P(json={
        "type": "object", "required": ["date", "color"], "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "color": {"enum": ["red", "green", "blue"]}}}),
    "json_object": P(json_object=True),
    "regex [ab]+": P(regex="[ab]+"),
    "regex e-mail": P(regex=r"[a-z0-9._%+-]{1,40}@[a-z0-9.-]{1,40}\.[a-z]{2,8}"),
    "choice of 3": P(choice=["yes", "no", "maybe"]),
    "choice of 2,000": P(choice=[f"option number {i} of many" for i in range(2000)]),
    "EBNF arithmetic": P(grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                         'term ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" expr ")"'),
}  # fmt: skip


def _busy() -> None:
    while True:
        pass


def _row(name: str, compile_ms: float, fills: list[float], accepts: list[float]) -> str:
    f, a = np.array(fills) * 1e3, np.array(accepts) * 1e3
    return (
        f"| {name} | {compile_ms:.1f} | {len(f)} | {np.median(f):.3f} | {f.max():.3f} | "
        f"{np.median(a):.3f} | {a.max():.3f} |"
    )


def engine_steps(seconds: float) -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=256, dtype="float32")
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    bad = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=P(regex=SLOW_REGEX))
    llm.generate(["warm up"], plain, use_tqdm=False)
    for label, beside in (("alone", False), ("beside the slow regex", True)):
        engine.add_request("plain", "The capital of France is", plain)
        if beside:
            engine.add_request("bad", "Write anything:", bad)  # compiled here
        steps, ended, start = [], {}, time.perf_counter()
        while engine.has_unfinished_requests() and time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    ended[out.request_id] = out.outputs[0].finish_reason
            steps.append(time.perf_counter() - t0)
        engine.abort_request(["plain", "bad"])
        while engine.has_unfinished_requests():
            engine.step()
        ms = " ".join(f"{s * 1e3:.0f}" for s in steps)
        print(f"{label}: {len(steps)} steps, ms: {ms}; finished: {ended}", flush=True)


def _fill_forever(backend: XgrammarBackend, params: P, stop: Any) -> None:
    """The first mask of `params` (0.66 s for the slow regex), again and again until `stop`."""
    bitmask = np.empty((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    while not stop.is_set():
        backend.new_state(params).fill_bitmask(bitmask, 0)


def abandoned_steps(counts: list[int]) -> None:
    """Step times of 4 plain requests decoding 32 greedy tokens each, while N mask fills of
    the slow regex run on threads of their own (as N fills the engine gave up on do: each
    keeps a core until xgrammar returns)."""
    import threading

    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=256, dtype="float32")
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(["warm up"], plain, use_tqdm=False)
    backend = engine.structured_output.backend
    backend.compile(P(regex=SLOW_REGEX))
    print("| fills running | step ms, median | p90 | max |")
    print("|---|---|---|---|")
    for n in counts:
        stop = threading.Event()
        args = (backend, P(regex=SLOW_REGEX), stop)
        threads = [threading.Thread(target=_fill_forever, args=args) for _ in range(n)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        for i in range(4):
            engine.add_request(f"p{n}-{i}", f"Story number {i}:", plain)
        steps = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0) * 1e3)
        stop.set()
        s = np.array(steps)
        print(f"| {n} | {np.median(s):.1f} | {np.percentile(s, 90):.1f} | {s.max():.1f} |")
        for t in threads:  # a fill in progress ends first
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slow-tokens", type=int, default=8)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--engine-seconds", type=float, default=60.0)
    ap.add_argument("--abandoned", default=None, help="e.g. 0,1,2,3,4: step times beside N fills")
    args = ap.parse_args()
    if args.engine:
        engine_steps(args.engine_seconds)
        return
    if args.abandoned is not None:
        abandoned_steps([int(n) for n in args.abandoned.split(",")])
        return
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    tok = get_tokenizer(embedded_model_path())
    vocab = 49152
    backend = XgrammarBackend(tok, vocab, tok.eos_token_id)
    bitmask = np.empty((1, -(-vocab // 32)), dtype=np.int32)
    print("| constraint | compile ms | tokens | mask ms, median | max | advance ms, median | max |")
    print("|---|---|---|---|---|---|---|")
    for name, params in CASES.items():
        t0 = time.perf_counter()
        backend.compile(params)
        compile_ms = (time.perf_counter() - t0) * 1e3
        rng, fills, accepts = random.Random(0), [], []
        for _ in range(3):
            state = backend.new_state(params)
            for _ in range(args.tokens):
                t0 = time.perf_counter()
                state.fill_bitmask(bitmask, 0)
                fills.append(time.perf_counter() - t0)
                bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab]
                allowed = [int(t) for t in np.flatnonzero(bits) if t != tok.eos_token_id]
                t0 = time.perf_counter()
                stop = state.accept_token(rng.choice(allowed) if allowed else tok.eos_token_id)
                accepts.append(time.perf_counter() - t0)
                if stop:
                    break
        print(_row(name, compile_ms, fills, accepts), flush=True)
    params = P(regex=SLOW_REGEX)
    t0 = time.perf_counter()
    backend.compile(params)
    compile_ms = (time.perf_counter() - t0) * 1e3
    state = backend.new_state(params)
    sentence = "Hello world, this is a test of the emergency broadcast system."
    fills, accepts = [], []
    for token in tok.encode(sentence, add_special_tokens=False)[: args.slow_tokens]:
        t0 = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.accept_token(token)
        accepts.append(time.perf_counter() - t0)
    print(_row(f"regex {SLOW_REGEX}", compile_ms, fills, accepts))
    print("slow regex, mask ms by token:", " ".join(f"{f * 1e3:.0f}" for f in fills))
    state, accepts = backend.new_state(params), []
    for token in tok.encode(sentence * 8, add_special_tokens=False)[:80]:
        t0 = time.perf_counter()
        state.accept_token(token)
        accepts.append(time.perf_counter() - t0)
    a = np.array(accepts) * 1e3
    print(
        f"slow regex, advancing through 80 tokens: median {np.median(a):.2f} ms, max {a.max():.1f}"
    )
    for p in busy:
        p.terminate()


if __name__ == "__main__":
    main()
