"""Turns a `SchedulerOutput` into one step's flat model inputs.

The scheduled tokens of all requests are laid end to end (decodes first, so attention backends
can batch them): input ids, positions, the KV-cache slot of every token, query start offsets,
sequence lengths and block tables, written into persistent numpy buffers with vectorised
arithmetic (Python touches each request, not each token) and handed to torch without copies
(on a GPU: one copy each from pinned memory). It also says which rows need logits: the rows
that sample (the last row of a request that reaches its end, plus one row per draft token) and
the prompt rows whose next-token logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.core.outputs import SchedulerOutput
from pagoda.core.request import Request


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    requests: list[Request]  # batch order (decodes first)
    # Rows of the hidden states to compute logits for, and for each sampling request the
    # slice of those rows it owns (1 + number of drafts).
    sample_rows: list[int] = field(default_factory=list)
    sample_reqs: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, lo, hi)
    # request -> (rows, target token ids) for prompt logprobs.
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)


class InputBuilder:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.max_num_reqs = max_num_reqs
        self._on_cpu = device.type == "cpu"
        self._alloc_tokens(max_num_tokens)
        self._alloc_reqs(max_num_reqs, max_blocks_per_req)

    def _zeros(self, shape: int | tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # On a GPU the host buffers are pinned, so the per-step copies are asynchronous.
        if self._on_cpu:
            return np.zeros(shape, dtype=dtype)
        t = torch.zeros(shape, dtype=torch.from_numpy(np.zeros(0, dtype)).dtype, pin_memory=True)
        return t.numpy()

    def _alloc_tokens(self, num_tokens: int) -> None:
        self.max_num_tokens = num_tokens
        self.input_ids = self._zeros(num_tokens, np.int64)
        self.positions = self._zeros(num_tokens, np.int64)
        self.slot_mapping = self._zeros(num_tokens, np.int64)
        self._arange = np.arange(max(num_tokens, self.max_num_reqs + 1), dtype=np.int64)

    def _alloc_reqs(self, num_reqs: int, num_blocks: int) -> None:
        self.max_num_reqs, self.max_blocks_per_req = num_reqs, num_blocks
        self.block_table = np.zeros((num_reqs, num_blocks), dtype=np.int32)
        self.query_start_loc = self._zeros(num_reqs + 1, np.int32)
        self.seq_lens = self._zeros(num_reqs, np.int32)
        self._arange = np.arange(max(self.max_num_tokens, num_reqs + 1), dtype=np.int64)

    def _grow(self, num_tokens: int, num_reqs: int, num_blocks: int) -> None:
        # Buffers are sized from the config; grow (rarely) rather than fail on a larger step.
        if num_tokens > self.max_num_tokens:
            self._alloc_tokens(num_tokens)
        if num_reqs > self.max_num_reqs or num_blocks > self.max_blocks_per_req:
            self._alloc_reqs(
                max(num_reqs, self.max_num_reqs), max(num_blocks, self.max_blocks_per_req)
            )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self._on_cpu else t.to(self.device, non_blocking=True)

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        n_sched = so.num_scheduled_tokens
        # Decodes (one token, no drafts) first, the rest after, each group in scheduler order.
        reqs = [r for r in so.scheduled_requests if n_sched[r.request_id] == 1]
        num_decodes = len(reqs)
        reqs += [r for r in so.scheduled_requests if n_sched[r.request_id] != 1]
        num_reqs = len(reqs)
        counts = np.fromiter((n_sched[r.request_id] for r in reqs), np.int64, num_reqs)
        starts = np.fromiter(
            (_start(so, r, n_sched[r.request_id]) for r in reqs), np.int64, num_reqs
        )
        num_tokens = int(counts.sum())
        seq_lens = starts + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if num_reqs else 0
        self._grow(num_tokens, num_reqs, max_blocks)

        qsl = self.query_start_loc
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : num_reqs + 1])
        self.seq_lens[:num_reqs] = seq_lens
        table = self.block_table
        ids = self.input_ids
        out = StepInputs(None, None, None, reqs)  # type: ignore[arg-type]
        for i, req in enumerate(reqs):
            rid = req.request_id
            blocks = so.block_ids[rid]
            nb = min(len(blocks), max_blocks)
            table[i, :nb] = blocks[:nb]
            table[i, nb:max_blocks] = 0  # the null block: padding, never attended
            lo, n, start = int(qsl[i]), int(counts[i]), int(starts[i])
            end = start + n
            all_ids = req.all_token_ids
            num_known = len(all_ids)
            if n == 1 and start < num_known:
                ids[lo] = all_ids[start]
            elif end <= num_known:
                ids[lo : lo + n] = all_ids[start:end]
            else:  # drafts to verify follow the known tokens
                ids[lo : lo + n] = (all_ids[start:] + req.spec_token_ids)[:n]
            num_spec = so.scheduled_spec_tokens.get(rid, 0)
            if end >= num_known:  # reaches the end: sample the last row and one per draft
                first = lo + n - 1 - num_spec
                out.sample_reqs.append(
                    (req, len(out.sample_rows), len(out.sample_rows) + 1 + num_spec)
                )
                out.sample_rows.extend(range(first, lo + n))
            if req.sampling_params.prompt_logprobs is not None:
                num_prompt = len(req.prompt_token_ids)
                stop = min(end, num_prompt - 1)  # positions whose next token is a prompt token
                if stop > start:
                    out.prompt_logprob_rows[rid] = (
                        list(range(lo, lo + stop - start)),
                        req.prompt_token_ids[start + 1 : stop + 1],
                    )

        # Per-token values, vectorised: request index, position and cache slot of every token.
        req_of_token = np.repeat(self._arange[:num_reqs], counts)
        positions = self.positions[:num_tokens]
        np.add(np.repeat(starts - qsl[:num_reqs], counts), self._arange[:num_tokens], out=positions)
        block_idx = positions // self.block_size
        blocks = table[req_of_token, block_idx].astype(np.int64)
        np.add(
            blocks * self.block_size,
            positions % self.block_size,
            out=self.slot_mapping[:num_tokens],
        )

        qsl_list = qsl[: num_reqs + 1].tolist()
        seq_lens_list = seq_lens.tolist()
        out.input_ids = self._to_device(ids[:num_tokens])
        out.positions = self._to_device(positions)
        out.attn_metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=self._to_device(self.slot_mapping[:num_tokens]),
            query_start_loc=self._to_device(qsl[: num_reqs + 1]),
            seq_lens=self._to_device(self.seq_lens[:num_reqs]),
            block_tables=self._to_device(np.ascontiguousarray(table[:num_reqs, :max_blocks])),
            max_query_len=int(counts.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            query_start_loc_cpu=qsl_list,
            seq_lens_cpu=seq_lens_list,
            num_decodes=num_decodes,
        )
        return out


def _start(so: SchedulerOutput, req: Request, num_scheduled: int) -> int:
    """Tokens already in the cache before this step (the scheduler records it; it has already
    advanced request.num_computed_tokens past this step)."""
    start = so.num_computed_tokens.get(req.request_id)
    return req.num_computed_tokens - num_scheduled if start is None else start
