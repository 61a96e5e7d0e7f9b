"""Turns a `SchedulerOutput` and the runner's requests (`request_state`) into one step's flat
model inputs, in persistent buffers.

The scheduled tokens of all requests are laid end to end (decodes first, so attention backends
can batch them): input ids, positions, the KV-cache slot of every token, query start offsets,
sequence lengths and block tables. They are written into host buffers allocated once (pinned
on a GPU) with vectorised numpy arithmetic (Python touches each request, not each token), then
sent with two non-blocking copies (token arrays, request arrays: each a prefix of one
allocation) into device buffers that are also allocated once: the tensors a step
hands to the model are always slices of the same memory, which is what lets a CUDA graph
captured over them (`pagoda.worker.cuda_graphs`) replay with new inputs. On a CPU the host
buffers are the device buffers (no copy). A step may be padded to a CUDA-graph bucket; padded
token rows get token 0 at position 0 and slot -1 (nothing written). A pure-decode step is
padded with one-token requests on the null block 0; any other step with empty requests and
one extra request that owns the padding tokens (`pagoda.worker.cuda_graphs.pad_mixed_requests`).
The builder also says which rows need logits: the rows that sample (the last row of a request
that reaches its end, plus one row per draft token) and the prompt rows whose next-token
logprobs were asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.core.outputs import SchedulerOutput
from pagoda.worker.cuda_graphs import pad_mixed_requests, pad_tokens
from pagoda.worker.request_state import RequestState


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_padded_tokens] int64
    positions: torch.Tensor  # [num_padded_tokens] int64
    attn_metadata: AttentionMetadata
    requests: list[RequestState]  # batch order (decodes first)
    num_tokens: int = 0  # scheduled tokens (rows past it are CUDA-graph padding)
    # Batch size of the decode CUDA graph this step is padded for, or (num_tokens, num_reqs)
    # of the mixed graph; both None: run eagerly.
    cuda_graph_size: int | None = None
    mixed_graph_shape: tuple[int, int] | None = None
    # Rows of the hidden states to compute logits for, and for each sampling request the
    # slice of those rows it owns (1 + number of drafts).
    sample_rows: list[int] = field(default_factory=list)
    sample_reqs: list[tuple[RequestState, int, int]] = field(default_factory=list)  # (req, lo, hi)
    # sample_rows on the device; None when they are rows 0 .. len(sample_rows) - 1 in order.
    logits_indices: torch.Tensor | None = None
    # request -> (rows, target token ids) for prompt logprobs.
    prompt_logprob_rows: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    # request -> (rows, index of their first row in prompt_logprob_token_ids) for the prompt
    # positions whose fixed token ids it scores.
    prompt_token_id_rows: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    # (row, request id) of the inputs whose token the previous step is still sampling (async
    # scheduling): the runner fills them from that step's sampled ids on the device.
    placeholder_rows: list[tuple[int, str]] = field(default_factory=list)

    @property
    def graph_key(self) -> int | tuple[int, int] | None:
        """The CUDA graph to replay (`CUDAGraphRunner.replay`), or None."""
        return self.cuda_graph_size if self.cuda_graph_size is not None else self.mixed_graph_shape


class _Array:
    """One input array: `host` (numpy, written by the builder) and `dev` (the tensor the model
    reads), views into a `_Staging` allocation."""

    def __init__(self, host: np.ndarray, dev: torch.Tensor) -> None:
        self.host, self.dev = host, dev


_ALIGN = 64  # elements: each staged array starts at least 256-byte aligned


def _layout(shapes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Each array's offset in one allocation, and the allocation's size, in elements."""
    offsets, total = [], 0
    for shape in shapes:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += math.prod(shape)
    return offsets, total


def _token_shapes(num_tokens: int) -> list[tuple[int, ...]]:
    # int64: ids, positions and slots of a step's tokens, then the rows to compute logits for.
    return [(num_tokens,)] * 4


def _req_shapes(num_reqs: int, num_blocks: int) -> list[tuple[int, ...]]:
    # int32: query start offsets, sequence lengths, block table. One spare request row: the
    # request that owns a mixed CUDA graph's padding tokens.
    return [(num_reqs + 2,), (num_reqs + 1,), (num_reqs + 1, num_blocks)]


@dataclass(frozen=True)
class InputBufferBytes:
    """What `InputBuilder` allocates for its sizes: `host` bytes of host memory (pinned on a
    GPU), `device` bytes of device memory besides (0 on a CPU, where they are the same)."""

    host: int
    device: int


def input_buffer_bytes(
    max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, copy_to_device: bool
) -> InputBufferBytes:
    """The memory an `InputBuilder` of these sizes takes, without allocating it: how a
    configuration that could never be allocated is refused where it is made."""
    staged = 8 * _layout(_token_shapes(max_num_tokens))[1]
    staged += 4 * _layout(_req_shapes(max_num_reqs, max_blocks_per_req))[1]
    arange = 8 * max(max_num_tokens, max_num_reqs + 2)
    return InputBufferBytes(staged + arange, staged if copy_to_device else 0)


class _Staging:
    """Arrays of one dtype at fixed offsets of one host allocation (pinned on a GPU) and one
    device allocation: a step sends all of them with a single copy of a prefix, since every
    host-to-device copy is a driver call that costs tens of microseconds of host time. Without
    copies (a CPU run) the host memory is the device memory."""

    def __init__(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, copies: bool
    ) -> None:
        self.offsets, total = _layout(shapes)
        pin = copies and device.type == "cuda"
        self.host_t = torch.zeros(total, dtype=dtype, pin_memory=pin)
        self.dev = torch.zeros(total, dtype=dtype, device=device) if copies else self.host_t
        self._copies = copies
        host = self.host_t.numpy()
        self.arrays = [
            _Array(
                host[o : o + int(np.prod(sh))].reshape(sh),
                self.dev[o : o + int(np.prod(sh))].view(sh),
            )
            for o, sh in zip(self.offsets, shapes)
        ]

    def commit(self, end: int) -> None:
        """Queue the copy of elements [0, end) to the device."""
        if self._copies:
            self.dev[:end].copy_(self.host_t[:end], non_blocking=True)


class InputBuilder:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        copy_to_device: bool | None = None,
    ) -> None:
        """`copy_to_device` (default: not on a CPU) keeps separate host and device buffers;
        tests turn it on for a CPU to run the copies a GPU needs."""
        self.block_size = block_size
        self.device = device
        self._copies = device.type != "cpu" if copy_to_device is None else copy_to_device
        self.max_num_tokens = 0
        self.max_num_reqs = max_num_reqs
        self.max_blocks_per_req = 0
        # Bumped whenever buffers are reallocated: graphs captured over the old ones are stale.
        self.generation = 0
        # The host buffers are reused every step: before writing them, wait until the copies
        # queued from them by the previous step have run, unless the runner has waited for the
        # device since (`copies_done`), as every step that samples does.
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None
        self._copies_pending = False
        # req_id -> (the request's block list in `RequestState`, ids copied, those ids as int32):
        # the list only grows while the request runs, so a step copies only new block ids.
        self._block_rows: dict[str, tuple[list[int], int, np.ndarray]] = {}
        self._alloc_tokens(max_num_tokens)
        self._alloc_reqs(max_num_reqs, max_blocks_per_req)

    def _alloc_tokens(self, num_tokens: int) -> None:
        self.max_num_tokens = num_tokens
        # Copied as one prefix: ids, positions and slots, then (rarely needed) logits rows.
        self._tokens = _Staging(_token_shapes(num_tokens), torch.int64, self.device, self._copies)
        self.input_ids, self.positions, self.slot_mapping, self.logits_indices = self._tokens.arrays
        self._arange = np.arange(max(num_tokens, self.max_num_reqs + 2), dtype=np.int64)
        self.generation += 1

    def _alloc_reqs(self, num_reqs: int, num_blocks: int) -> None:
        self.max_num_reqs, self.max_blocks_per_req = num_reqs, num_blocks
        # Copied as one prefix up to the last block-table row of the step.
        self._reqs = _Staging(
            _req_shapes(num_reqs, num_blocks), torch.int32, self.device, self._copies
        )
        self.query_start_loc, self.seq_lens, self.block_table = self._reqs.arrays
        self._arange = np.arange(max(self.max_num_tokens, num_reqs + 2), dtype=np.int64)
        self.generation += 1

    def _grow(self, num_tokens: int, num_reqs: int, num_blocks: int) -> None:
        # Buffers are sized from the config; grow (rarely) rather than fail on a larger step.
        if num_tokens > self.max_num_tokens:
            self._alloc_tokens(num_tokens)
        if num_reqs > self.max_num_reqs or num_blocks > self.max_blocks_per_req:
            self._alloc_reqs(
                max(num_reqs, self.max_num_reqs), max(num_blocks, self.max_blocks_per_req)
            )

    # -- CUDA-graph views --------------------------------------------------------------------
    def decode_metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """Attention metadata of a (padded) pure-decode batch of `batch_size` rows whose tensors
        are the device buffers themselves: what a CUDA graph is captured with. No CPU copies
        of the lengths: they would be baked into the graph."""
        return AttentionMetadata(
            num_actual_tokens=batch_size,
            slot_mapping=self.slot_mapping.dev[:batch_size],
            query_start_loc=self.query_start_loc.dev[: batch_size + 1],
            seq_lens=self.seq_lens.dev[:batch_size],
            block_tables=self.block_table.dev[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            num_decodes=batch_size,
        )

    def prepare_padding_only(self, batch_size: int) -> None:
        """Fill the first `batch_size` rows with padding (what graph capture runs on)."""
        self._wait_for_copies()
        self._pad(0, 0, batch_size)
        self.block_table.host[:batch_size, 0] = 0
        self._commit(batch_size, batch_size, 0)

    def mixed_metadata(self, num_tokens: int, num_reqs: int, max_seq_len: int) -> AttentionMetadata:
        """Attention metadata of a step padded to the mixed graph (num_tokens, num_reqs) over
        the device buffers (num_reqs + 1 request slots, see `pad_mixed_requests`). No CPU
        copies; max_query_len is the token bucket, so the kernel tiling fits any step in it."""
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=self.slot_mapping.dev[:num_tokens],
            query_start_loc=self.query_start_loc.dev[: num_reqs + 2],
            seq_lens=self.seq_lens.dev[: num_reqs + 1],
            block_tables=self.block_table.dev[: num_reqs + 1],
            max_query_len=num_tokens,
            max_seq_len=max_seq_len,
        )

    def prepare_mixed_padding_only(self, num_tokens: int, num_reqs: int) -> None:
        """Fill a mixed graph's rows with padding only (what its capture runs on)."""
        self._wait_for_copies()
        pad_tokens(self.input_ids.host, self.positions.host, self.slot_mapping.host, 0, num_tokens)
        pad_mixed_requests(
            self.query_start_loc.host,
            self.seq_lens.host,
            self.block_table.host,
            0,
            0,
            num_tokens,
            num_reqs,
            self.block_size,
        )
        self._commit(num_tokens, num_reqs + 1, 0)

    # -- one step ----------------------------------------------------------------------------
    def _block_row(self, req_id: str, blocks: list[int]) -> np.ndarray:
        """The request's block ids as an int32 array, converting only the ids added since the
        last step (a different list object, e.g. after preemption, starts over)."""
        n = len(blocks)
        cached = self._block_rows.get(req_id)
        if cached is not None and cached[0] is blocks and 0 < cached[1] <= n:
            _, done, row = cached
            if done == n and row[n - 1] == blocks[n - 1]:
                return row[:n]
            if row[done - 1] == blocks[done - 1]:
                if n > len(row):
                    row = np.resize(row, 2 * n)
                row[done:n] = blocks[done:n]
                self._block_rows[req_id] = (blocks, n, row)
                return row[:n]
        row = np.empty(max(2 * n, 16), dtype=np.int32)
        row[:n] = blocks
        self._block_rows[req_id] = (blocks, n, row)
        return row[:n]

    def forget(self, req_ids: set[str]) -> None:
        """Drop what is kept for requests that finished or were preempted."""
        for rid in req_ids:
            self._block_rows.pop(rid, None)

    def _wait_for_copies(self) -> None:
        if self._copies_pending and self._copies_done is not None:
            self._copies_done.synchronize()
        self._copies_pending = False

    def copies_done(self) -> None:
        """Tell the builder that the host has waited for the device since the last step's
        inputs were queued (e.g. for sampled tokens): its next step need not wait again."""
        self._copies_pending = False

    def _pad(self, num_tokens: int, num_reqs: int, batch_size: int) -> None:
        """Rows [num_reqs, batch_size) become one-token requests at position 0 of the null
        block that write nothing; `num_tokens` must equal `num_reqs` (a pure-decode batch)."""
        n_pad = batch_size - num_reqs
        pad_tokens(
            self.input_ids.host, self.positions.host, self.slot_mapping.host, num_tokens, batch_size
        )
        qsl = self.query_start_loc.host
        qsl[num_reqs + 1 : batch_size + 1] = num_tokens + 1 + self._arange[:n_pad]
        if num_reqs == 0:
            qsl[0] = 0
        self.seq_lens.host[num_reqs:batch_size] = 1

    def _commit(self, num_tokens: int, num_reqs: int, num_logits_indices: int) -> None:
        """Queue this step's two copies: token arrays, then request arrays (block-table rows
        at full width: a CUDA graph reads them with the captured row stride)."""
        tok_end = self._tokens.offsets[2] + num_tokens
        if num_logits_indices:
            tok_end = self._tokens.offsets[3] + num_logits_indices
        self._tokens.commit(tok_end)
        self._reqs.commit(self._reqs.offsets[2] + num_reqs * self.max_blocks_per_req)
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True

    def prepare(
        self,
        so: SchedulerOutput,
        requests: list[RequestState],
        cuda_graph_size: Callable[[int], int | None] | None = None,
        mixed_graph_shape: Callable[[int, int], tuple[int, int] | None] | None = None,
    ) -> StepInputs:
        """Build the step's inputs: `requests` are the step's, in the scheduler's batch order,
        as `RequestStates.update(so)` returns them. `cuda_graph_size(num_reqs)` gives the
        padded batch size of a pure-decode step that can replay a CUDA graph,
        `mixed_graph_shape(num_tokens, num_reqs)` the (tokens, requests) bucket of any other
        step that can (None: eager)."""
        self._wait_for_copies()
        self.forget(so.finished_req_ids)
        self.forget(so.preempted_req_ids)
        if len(self._block_rows) > 4 * self.max_num_reqs:  # ids never reported finished
            self._block_rows.clear()
        n_sched = so.num_scheduled_tokens
        # Decodes (one token, no drafts) first, the rest after, each group in scheduler order.
        reqs = [r for r in requests if n_sched[r.req_id] == 1]
        num_decodes = len(reqs)
        reqs += [r for r in requests if n_sched[r.req_id] != 1]
        num_reqs = len(reqs)
        counts = np.fromiter((n_sched[r.req_id] for r in reqs), np.int64, num_reqs)
        start_of = so.num_computed_tokens
        starts = np.fromiter((start_of[r.req_id] for r in reqs), np.int64, num_reqs)
        num_tokens = int(counts.sum())
        seq_lens = starts + counts
        max_blocks = int(-(-seq_lens.max() // self.block_size)) if num_reqs else 0
        self._grow(num_tokens, num_reqs, max_blocks)
        # After _grow: a graph over reallocated buffers is stale and declines (None).
        graph_size = mixed = None
        if num_reqs and num_decodes == num_reqs:
            if cuda_graph_size is not None:
                graph_size = cuda_graph_size(num_reqs)
        elif num_reqs and mixed_graph_shape is not None:
            mixed = mixed_graph_shape(num_tokens, num_reqs)
        padded = graph_size or num_reqs

        qsl = self.query_start_loc.host
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1 : num_reqs + 1])
        self.seq_lens.host[:num_reqs] = seq_lens
        table = self.block_table.host
        ids = self.input_ids.host
        out = StepInputs(None, None, None, reqs, num_tokens)  # type: ignore[arg-type]
        # Python ints: indexing numpy scalars in this per-request loop costs more than it does.
        los, ns, start_list = qsl[:num_reqs].tolist(), counts.tolist(), starts.tolist()
        spec = so.scheduled_spec_decode_tokens
        for i, req in enumerate(reqs):
            rid = req.req_id
            blocks = self._block_row(rid, req.block_ids)[:max_blocks]
            nb = len(blocks)
            table[i, :nb] = blocks
            if nb < max_blocks:
                table[i, nb:max_blocks] = 0  # the null block: padding, never attended
            lo, n, start = los[i], ns[i], start_list[i]
            end = start + n
            all_ids = req.all_token_ids
            num_known = len(all_ids)
            if n == 1 and start < num_known:
                ids[lo] = all_ids[start]
            elif end <= num_known:
                ids[lo : lo + n] = all_ids[start:end]
            elif n == 1 and start == num_known and rid not in spec:
                # Async scheduling: the previous step is still sampling this token.
                out.placeholder_rows.append((lo, rid))
            else:  # drafts to verify follow the known tokens
                ids[lo : lo + n] = (all_ids[start:] + spec.get(rid, []))[:n]
            num_spec = len(spec.get(rid, ()))
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
            if req.sampling_params.prompt_logprob_token_ids is not None:
                first = max(start, req.sampling_params.prompt_logprob_start or 0)
                stop = min(end, len(req.prompt_token_ids) - 1)  # the last predicts an output
                if stop > first:
                    out.prompt_token_id_rows[rid] = (
                        list(range(lo + first - start, lo + stop - start)),
                        first - (req.sampling_params.prompt_logprob_start or 0),
                    )

        # Per-token values, vectorised: request index, position and cache slot of every token.
        req_of_token = np.repeat(self._arange[:num_reqs], counts)
        positions = self.positions.host[:num_tokens]
        np.add(np.repeat(starts - qsl[:num_reqs], counts), self._arange[:num_tokens], out=positions)
        block_idx = positions // self.block_size
        blocks = table[req_of_token, block_idx].astype(np.int64)
        np.add(
            blocks * self.block_size,
            positions % self.block_size,
            out=self.slot_mapping.host[:num_tokens],
        )
        if graph_size is not None:
            self._pad(num_tokens, num_reqs, graph_size)
            table[num_reqs:graph_size, 0] = 0
        elif mixed is not None:
            pad_tokens(ids, self.positions.host, self.slot_mapping.host, num_tokens, mixed[0])
            pad_mixed_requests(
                qsl, self.seq_lens.host, table, num_tokens, num_reqs, *mixed, self.block_size
            )
            padded = mixed[1] + 1  # request rows to copy, the padding owner's included
        num_rows = mixed[0] if mixed is not None else max(num_tokens, padded)
        rows = out.sample_rows
        num_indices = 0
        if rows and (rows[-1] != len(rows) - 1 or rows[0] != 0):
            # Not simply the first len(rows) rows (rows are increasing, so ends suffice).
            num_indices = len(rows)
            self.logits_indices.host[:num_indices] = rows
            out.logits_indices = self.logits_indices.dev[:num_indices]
        self._commit(num_rows, padded, num_indices)

        out.input_ids = self.input_ids.dev[:num_rows]
        out.positions = self.positions.dev[:num_rows]
        out.cuda_graph_size, out.mixed_graph_shape = graph_size, mixed
        if graph_size is not None:
            out.attn_metadata = self.decode_metadata(graph_size, int(seq_lens.max()))
        elif mixed is not None:
            out.attn_metadata = self.mixed_metadata(*mixed, int(seq_lens.max()))
        else:
            out.attn_metadata = AttentionMetadata(
                num_actual_tokens=num_tokens,
                slot_mapping=self.slot_mapping.dev[:num_tokens],
                query_start_loc=self.query_start_loc.dev[: num_reqs + 1],
                seq_lens=self.seq_lens.dev[:num_reqs],
                block_tables=self.block_table.dev[:num_reqs, :max_blocks],
                max_query_len=int(counts.max()) if num_reqs else 0,
                max_seq_len=int(seq_lens.max()) if num_reqs else 0,
                query_start_loc_cpu=qsl[: num_reqs + 1].tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                num_decodes=num_decodes,
            )
        return out
