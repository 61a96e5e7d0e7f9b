"""Whether llama.cpp's greedy outputs depend on how its prompt is batched: the 10 prompts of
`cpu_vs_llamacpp.py`, 32 greedy tokens each, with the prompt evaluated in one 512-token batch,
in batches of 4 and one token at a time (llama-cpp-python, the embedded GGUF, f16 KV cache).

    python benchmarks/llamacpp_batch_invariance.py --llamacpp-python /path/to/venv/bin/python

Prints, per setting, how many prompts give the same tokens as the 512-token batch. Equal
outputs mean ggml computes each row the same whatever the batch, so matching its greedy
outputs takes its exact arithmetic, op by op (`greedy_noise_floor.py` shows how little moves
the tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from cpu_vs_llamacpp import GREEDY_TOKENS, PROMPTS  # noqa: E402

WORKER = r"""
import json, sys
from llama_cpp import Llama
job = json.load(sys.stdin)
out = {}
for n_batch in job["batches"]:
    llm = Llama(job["model"], n_ctx=1024, n_batch=n_batch, n_ubatch=n_batch,
                n_threads=job["threads"], n_threads_batch=job["threads"], type_k=1, type_v=1,
                verbose=False)
    runs = []
    for ids in job["prompts"]:
        toks = []
        for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            if len(toks) == job["tokens"]:
                break
        runs.append(toks)
    out[str(n_batch)] = runs
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llamacpp-python", required=True, help="python of a llama-cpp-python venv")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    from pagoda.config import embedded_model_path
    from pagoda.tokenizer import get_tokenizer

    model = embedded_model_path()
    tok = get_tokenizer(model)
    job = {
        "model": model,
        "threads": args.threads,
        "batches": [512, 4, 1],
        "prompts": [tok.encode(t) for t in PROMPTS],
        "tokens": GREEDY_TOKENS,
    }
    proc = subprocess.run(
        [args.llamacpp_python, "-c", WORKER], input=json.dumps(job), capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"llama.cpp worker failed:\n{proc.stderr[-3000:]}")
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    base = runs["512"]
    for n_batch, outs in runs.items():
        same = sum(a == b for a, b in zip(base, outs))
        print(f"n_batch {n_batch:>3s}: {same}/{len(PROMPTS)} prompts as with n_batch 512")


if __name__ == "__main__":
    main()
