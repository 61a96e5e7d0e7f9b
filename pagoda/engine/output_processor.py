"""Output processing, in the front end: the engine core's per-step `EngineCoreOutput`s (token
ids, raw logprobs, finish reasons) become user-facing `RequestOutput`s.

Owns, per request: incremental detokenization and stop strings, logprobs (with decoded
tokens), the cumulative logprob, the fan-in of n > 1 samples into one `RequestOutput`, the
CUMULATIVE / DELTA / FINAL_ONLY output kinds, the stream interval (a streamed request's output
goes out once a sample has that many new tokens, and always at its first token and its end:
DELTA chunks then hold the tokens and text of the steps skipped), and the per-request timing
behind the metrics.

A failure while processing one request's output (detokenizing, a stop string, a logprob)
finishes that request alone, with finish_reason "error" and the error in its output; the
others in the step go on. So does a sample the engine core ended with an error (its constraint
too slow to apply): the request's other samples end with it, and its output says the error is
the request's own (`client_error`). Requests that end by abort are counted too (their
statistics reach the next step's `IterationStats`), under finish_reason "abort": a client that
left, and a request dropped after waiting --max-queue-delay-s (its 503 ends a request the
engine had admitted, unlike a 503 at the door, which never becomes one and is counted by
admission_rejections_total; vLLM counts the aborts its engine makes under "abort" too). A
request that never left the queue has only queue time. With a `RequestTracer`
(--otlp-traces-endpoint) each user request that ends, by abort too, becomes one "llm_request"
span built from these timestamps (`pagoda.tracing`), in the trace its headers name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pagoda.core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.metrics.stats import FinishedRequestStats, IterationStats
from pagoda.outputs import (
    CompletionOutput,
    FlatLogprobs,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    create_prompt_logprobs,
    create_sample_logprobs,
)
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.tokenizer import Tokenizer
from pagoda.tracing import RequestTracer, request_span_attributes

logger = logging.getLogger(__name__)


@dataclass
class SampleState:
    """One sample (child request) of a user request."""

    request_id: str
    index: int
    parent: ParentState
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0
    last_token_time: float | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    final_sent: bool = False  # DELTA: the finished sample was reported
    num_emitted_tokens: int = 0  # its tokens when an output last went out (stream interval)
    emitted_finished: bool = False  # an output went out since it finished
    max_tokens: int | None = None  # resolved against the context (the core request's)
    num_cached_tokens: int = 0  # its prompt tokens the prefix cache held
    num_preemptions: int = 0
    # Detailed traces: its steps' summed model forward / executor seconds (the core's).
    model_forward_time: float | None = None
    model_execute_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ParentState:
    """A user request: its prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[SampleState] = field(default_factory=list)
    stream_interval: int = 1
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    # prompt_logprob_token_ids: the rows scored so far, then (all in) their array.
    prompt_token_id_rows: list[list[float]] | None = None
    prompt_token_id_logprobs: np.ndarray | None = None
    prompt_token_id_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # why it finished with "error"
    client_error: bool = False  # the request's own doing (the engine core said so)
    trace_headers: Mapping[str, str] | None = None  # its HTTP request's traceparent / tracestate

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        tracer: RequestTracer | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.stream_interval = stream_interval  # the engine's; a request's may raise it
        self.samples: dict[str, SampleState] = {}  # child request id -> state
        self.parents: dict[str, ParentState] = {}  # user request id -> state
        # Samples ended by abort since the last step: counted in the next step's statistics,
        # with their user requests' (n, most tokens a sample generated).
        self._aborted_stats: list[FinishedRequestStats] = []
        self._aborted_parents: list[tuple[int, int]] = []

    # -- bookkeeping -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        samples: list[EngineCoreRequest],
        arrival_time: float,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Track request `request_id`, whose `samples` (one core request each) go to the core;
        `trace_headers` put its span in the caller's trace. Raises ValueError, tracking
        nothing, when one of their ids is in use."""
        clash = self.id_in_use(request_id, [s.request_id for s in samples])
        if clash is not None:
            raise ValueError(clash)
        parent = ParentState(request_id, prompt, prompt_token_ids, params, arrival_time)
        parent.trace_headers = trace_headers
        parent.stream_interval = max(params.stream_interval or 1, self.stream_interval)
        for index, sample in enumerate(samples):
            child_id, p = sample.request_id, sample.sampling_params
            detok = None
            if p.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                    stop=list(p.stop or []),
                    include_stop_str_in_output=p.include_stop_str_in_output,
                    min_tokens=p.min_tokens,
                )
            state = SampleState(child_id, index, parent, p, detok, max_tokens=sample.max_tokens)
            if p.num_logprobs is not None:
                state.logprobs = create_sample_logprobs(p.flat_logprobs)
                state.cumulative_logprob = 0.0
            parent.samples.append(state)
            self.samples[child_id] = state
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = create_prompt_logprobs(params.flat_logprobs)
        if params.prompt_logprob_token_ids is not None:
            parent.prompt_token_id_rows = []
        self.parents[request_id] = parent

    def id_in_use(self, request_id: str, child_ids: list[str]) -> str | None:
        """Why request `request_id` with samples `child_ids` cannot be tracked (an id of an
        unfinished request or sample: a client may pick "0_x", the first sample's id of a
        request "x" with n > 1), or None."""
        if request_id in self.parents:
            return f"request_id {request_id!r} is already in use by an unfinished request"
        for cid in child_ids:
            if cid in self.samples:
                return (
                    f"request_id {request_id!r}: its sample id {cid!r} is in use by the "
                    f"unfinished request {self.samples[cid].parent.request_id!r}"
                )
        return None

    def parents_of(self, child_ids: list[str]) -> list[str]:
        """The user requests of these child ids (each once, in order; unknown ids skipped)."""
        parents: dict[str, None] = {}
        for cid in child_ids:
            state = self.samples.get(cid)
            if state is not None:
                parents[state.parent.request_id] = None
        return list(parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request_id for s in parent.samples] if parent else []

    def discard(self, request_id: str) -> None:
        """Forget a request the engine core refused (it never ran: no statistics)."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for s in parent.samples:
                self.samples.pop(s.request_id, None)

    def abort_requests(self, request_ids: list[str], now: float | None = None) -> list[str]:
        """Forget user requests; return the child ids the engine core must abort."""
        children: list[str] = []
        now = time.time() if now is None else now
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for s in parent.samples:
                self.samples.pop(s.request_id, None)
                if not s.finished:
                    children.append(s.request_id)
                    s.finish_reason = "abort"
                    self._aborted_stats.append(self._finished_stats(s, now))
            self._aborted_parents.append(_parent_stats(parent))
            if self.tracer is not None:
                self._trace(parent, now)
        return children

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def mark_scheduled(self, child_id: str, now: float) -> None:
        state = self.samples.get(child_id)
        if state is not None and state.first_scheduled_time is None:
            state.first_scheduled_time = now

    # -- per step ----------------------------------------------------------------------------
    def process_core_outputs(
        self, core_out: EngineCoreOutputs, now: float | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """One `EngineCore.step()`'s result: its scheduling times, then its outputs (see
        `process_outputs`; the step's `iteration_stats` get the timings and finished requests)."""
        for rid, t in core_out.first_scheduled.items():
            self.mark_scheduled(rid, t)
        for rid in core_out.preempted:
            state = self.samples.get(rid)
            if state is not None:
                state.num_preemptions += 1
        now = time.time() if now is None else now
        return self.process_outputs(core_out.outputs, now, core_out.iteration_stats)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput], now: float, stats: IterationStats
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs for users, child ids stopped early: a stop string or an error in
        their processing; the engine core must abort them)."""
        touched: dict[str, ParentState] = {}
        stopped_early: list[str] = []
        stats.finished_requests.extend(self._aborted_stats)
        self._aborted_stats = []
        for n, max_gen in self._aborted_parents:
            stats.n_params_iter.append(n)
            stats.max_num_generation_tokens_iter.append(max_gen)
        self._aborted_parents = []
        for out in core_outputs:
            state = self.samples.get(out.request_id)
            if state is None or state.finished:
                continue  # aborted meanwhile
            parent = state.parent
            touched[parent.request_id] = parent
            try:
                if self._process_one(state, out, now, stats):
                    stopped_early.append(state.request_id)
                if out.finish_reason == "error":
                    self._end_with_core_error(parent, out.error)
                    stopped_early.extend(s.request_id for s in parent.samples if s is not state)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the rest
                self._fail_request(parent, e)
                stopped_early.extend(s.request_id for s in parent.samples)

        outputs: list[RequestOutput] = []
        for parent in touched.values():
            for s in parent.samples:
                if s.finished and s.request_id in self.samples:
                    self.samples.pop(s.request_id)
                    stats.finished_requests.append(self._finished_stats(s, now))
            try:
                ro = self._make_output(parent, now)
            except Exception as e:  # noqa: BLE001 - as above
                self._fail_request(parent, e)
                stopped_early.extend(s.request_id for s in parent.samples)
                for s in parent.samples:
                    if self.samples.pop(s.request_id, None) is not None:
                        stats.finished_requests.append(self._finished_stats(s, now))
                ro = self._error_output(parent, now)
            if ro is not None:
                outputs.append(ro)
            if parent.finished and self.parents.pop(parent.request_id, None) is not None:
                n, max_gen = _parent_stats(parent)
                stats.n_params_iter.append(n)
                stats.max_num_generation_tokens_iter.append(max_gen)
                if self.tracer is not None:
                    self._trace(parent, now)
        return outputs, stopped_early

    def _process_one(
        self, state: SampleState, out: EngineCoreOutput, now: float, stats: IterationStats
    ) -> bool:
        """Take one sample's step output; True when a stop string ended it."""
        parent = state.parent
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        # Each of n samples scores the same prompt: the first one's scores are the request's.
        first = state.index == 0
        if out.new_prompt_logprobs and parent.prompt_logprobs is not None and first:
            self._add_logprobs(parent.prompt_logprobs, out.new_prompt_logprobs)
        rows = parent.prompt_token_id_rows
        if out.new_prompt_token_id_logprobs and rows is not None and first:
            rows.extend(out.new_prompt_token_id_logprobs)
            if len(rows) == len(parent.params.prompt_logprob_token_ids):
                parent.prompt_token_id_logprobs = np.array(rows, dtype=np.float32)
                parent.prompt_token_id_rows = None
        stopped = False
        if out.new_token_ids:
            self._record_timing(state, out, now, stats)
            stopped = self._append_tokens(state, out)
        if out.finish_reason is not None and state.finish_reason is None:
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        if out.finish_reason is not None:
            state.model_forward_time = out.model_forward_time
            state.model_execute_time = out.model_execute_time
        return stopped

    def _fail_request(self, parent: ParentState, error: Exception) -> None:
        """Finish every sample of `parent` with finish_reason "error" (the failure is logged
        here, with its traceback; the client sees only that the request failed)."""
        logger.exception("request %s failed in output processing", parent.request_id)
        parent.error = f"{type(error).__name__} while processing the request's output"
        for s in parent.samples:
            if not s.finished:
                s.finish_reason, s.stop_reason = "error", None

    def _end_with_core_error(self, parent: ParentState, error: str | None) -> None:
        """A sample the engine core ended with an error: the request's fault, which ends its
        other samples too."""
        if parent.error is None:
            parent.error = error or "the engine ended the request with an error"
            parent.client_error = True
        for s in parent.samples:
            if not s.finished:
                s.finish_reason, s.stop_reason = "error", None

    def _error_output(self, parent: ParentState, now: float) -> RequestOutput:
        """The last output of a request whose output could not be built: no new text."""
        samples = [
            CompletionOutput(s.index, "", [], None, None, finish_reason="error")
            for s in parent.samples
        ]
        return RequestOutput(
            parent.request_id, parent.prompt, parent.prompt_token_ids, None, samples,
            finished=True, error=parent.error, client_error=parent.client_error,
        )  # fmt: skip

    def _record_timing(
        self, s: SampleState, out: EngineCoreOutput, now: float, stats: IterationStats
    ) -> None:
        stats.num_generation_tokens += len(out.new_token_ids)
        if s.first_token_time is None:
            s.first_token_time = now
            stats.time_to_first_tokens_iter.append(now - s.parent.arrival_time)
            # The whole prompt, as vLLM's prompt_tokens_total, split by prefix-cache hits.
            stats.prompt_token_stats.update(len(s.parent.prompt_token_ids), out.num_cached_tokens)
        elif s.last_token_time is not None:
            stats.inter_token_latencies_iter.append(now - s.last_token_time)
        s.last_token_time = now

    def _append_tokens(self, s: SampleState, out: EngineCoreOutput) -> bool:
        """Add new tokens; True when a stop string ended the sample."""
        new_ids = out.new_token_ids
        if out.new_logprobs is not None and s.logprobs is not None:
            self._add_logprobs(s.logprobs, out.new_logprobs)
            if s.cumulative_logprob is not None:
                for tok, entry in zip(new_ids, out.new_logprobs):
                    if tok in entry:
                        s.cumulative_logprob += entry[tok][0]
        if s.detokenizer is None:
            s.token_ids.extend(new_ids)
            return False
        # The token that stopped the request (EOS or a stop token id: the engine's "stop") stays
        # in token_ids but, as in vLLM, out of the text unless include_stop_str_in_output (with
        # skip_special_tokens false, EOS would otherwise end every text).
        last = len(new_ids) - 1
        stop_token = out.finish_reason == "stop" and not s.detokenizer.include_stop_str_in_output
        for i, tok in enumerate(new_ids):
            s.token_ids.append(tok)
            if stop_token and i == last:
                break
            stop_str = s.detokenizer.update([tok])
            if stop_str is not None:
                # Tokens after the one completing the stop string are dropped, and the string
                # is the reason even where the core ended the request on this token (its
                # length cap, or a stop token kept in the text), as in vLLM.
                if s.logprobs is not None:  # (a slice: FlatLogprobs cannot delete)
                    s.logprobs = s.logprobs[: len(s.token_ids)]
                del new_ids[i + 1 :]
                s.finish_reason, s.stop_reason = "stop", stop_str
                return out.finish_reason is None  # the core still runs it: abort it there
        return False

    def _decoded(self, token_ids: Iterable[int]) -> list[str | None]:
        """Each token's text (None each without a tokenizer)."""
        if self.tokenizer is None:
            return [None for _ in token_ids]
        decode = self.tokenizer.decode
        return [decode([t], skip_special_tokens=False) for t in token_ids]

    def _to_logprob_dict(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {
            tok: Logprob(lp, rank, text)
            for (tok, (lp, rank)), text in zip(entry.items(), self._decoded(entry))
        }

    def _add_logprobs(
        self,
        logprobs: SampleLogprobs | PromptLogprobs,
        entries: list[dict[int, tuple[float, int]]],
    ) -> None:
        """Positions' {token: (logprob, rank)} onto a request's logprobs: straight into a
        `FlatLogprobs`'s lists (no dict of `Logprob`s a position), else as those dicts."""
        if not isinstance(logprobs, FlatLogprobs):
            logprobs.extend(self._to_logprob_dict(e) for e in entries)
            return
        for e in entries:
            values = e.values()
            logprobs.append_fast(
                e, [v[0] for v in values], [v[1] for v in values], self._decoded(e)
            )

    def _completion(self, s: SampleState, delta: bool) -> CompletionOutput:
        text = ""
        if s.detokenizer is not None:
            text = s.detokenizer.get_next_output_text(s.finished, delta)
        if delta:
            token_ids = s.token_ids[s.num_sent_tokens :]
            logprobs = s.logprobs[s.num_sent_logprobs :] if s.logprobs is not None else None
            s.num_sent_tokens = len(s.token_ids)
            s.num_sent_logprobs = len(s.logprobs) if s.logprobs is not None else 0
        else:
            token_ids = list(s.token_ids)
            logprobs = s.logprobs[:] if s.logprobs is not None else None  # a copy
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=s.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    def _make_output(self, parent: ParentState, now: float) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        if parent.stream_interval > 1 and not parent.finished and not _interval_due(parent):
            return None
        for s in parent.samples:
            s.num_emitted_tokens, s.emitted_finished = len(s.token_ids), s.finished
        delta = kind == RequestOutputKind.DELTA
        if delta:
            samples = [
                s
                for s in parent.samples
                if not s.final_sent and (len(s.token_ids) > s.num_sent_tokens or s.finished)
            ]
            for s in samples:
                s.final_sent = s.finished
        else:
            samples = parent.samples
        prompt_logprobs = _sent_once(parent, "prompt_logprobs", delta, bool(samples))
        # As vLLM: the array once all its rows are in; a DELTA stream has it once.
        token_id_logprobs = _sent_once(parent, "prompt_token_id_logprobs", delta, bool(samples))
        first = parent.samples[0]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=now if parent.finished else None,
            time_in_queue=(first.first_scheduled_time - parent.arrival_time)
            if first.first_scheduled_time is not None
            else None,
        )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            prompt_token_id_logprobs=token_id_logprobs,
            outputs=[self._completion(s, delta) for s in samples],
            finished=parent.finished,
            metrics=metrics,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
            client_error=parent.client_error,
        )

    def _finished_stats(self, s: SampleState, now: float) -> FinishedRequestStats:
        """The sample's statistics as it ends at `now`. One never scheduled (aborted while
        waiting, or dropped after --max-queue-delay-s) waited all its life: queue time only."""
        arrival, first_tok = s.parent.arrival_time, s.first_token_time
        scheduled = s.first_scheduled_time
        if scheduled is None:
            scheduled = first_tok if first_tok is not None else now
        n_gen = len(s.token_ids)
        prefill = decode = tpot = None
        if first_tok is not None:
            prefill = first_tok - scheduled
            decode = (s.last_token_time or first_tok) - first_tok
            tpot = decode / (n_gen - 1) if n_gen > 1 else None
        return FinishedRequestStats(
            finish_reason=s.finish_reason or "abort",
            e2e_latency=now - arrival,
            num_prompt_tokens=len(s.parent.prompt_token_ids),
            num_generation_tokens=n_gen,
            queued_time=scheduled - arrival,
            prefill_time=prefill,
            decode_time=decode,
            mean_time_per_output_token=tpot,
            num_cached_tokens=s.num_cached_tokens,
            num_preemptions=s.num_preemptions,
            max_tokens_param=s.max_tokens,
        )

    def _trace(self, parent: ParentState, now: float) -> None:
        """Emit the ended request's "llm_request" span (vLLM's `do_tracing`): one per user
        request, its samples' tokens summed (the response's usage), its phases from the
        earliest sample's start to the latest's last token; a detailed timing is its longest
        sample's (they share their steps). A failure is logged: tracing never fails a request."""
        assert self.tracer is not None
        samples = parent.samples
        try:
            attributes = request_span_attributes(
                request_id=parent.request_id,
                model=self.tracer.model_name,
                params=parent.params,
                max_tokens=samples[0].max_tokens if samples else None,
                num_prompt_tokens=len(parent.prompt_token_ids),
                num_generation_tokens=sum(len(s.token_ids) for s in samples),
                num_cached_tokens=parent.num_cached_tokens,
                finish_reasons=[s.finish_reason or "abort" for s in samples],
                arrival_time=parent.arrival_time,
                first_scheduled_time=_earliest(s.first_scheduled_time for s in samples),
                first_token_time=_earliest(s.first_token_time for s in samples),
                last_token_time=_latest(s.last_token_time for s in samples),
                finished_time=now,
                model_forward_time=_latest(s.model_forward_time for s in samples),
                model_execute_time=_latest(s.model_execute_time for s in samples),
            )
            self.tracer.emit(attributes, parent.arrival_time, now, parent.trace_headers)
        except Exception:  # noqa: BLE001 - a span is not worth a request
            logger.exception("tracing request %s failed", parent.request_id)


def _earliest(times: Iterable[float | None]) -> float | None:
    return min((t for t in times if t is not None), default=None)


def _latest(times: Iterable[float | None]) -> float | None:
    return max((t for t in times if t is not None), default=None)


def _interval_due(parent: ParentState) -> bool:
    """Whether a streamed request's output goes out now (vLLM's rule, per sample): a sample's
    first tokens, its end, or `stream_interval` new tokens since the last output."""
    return any(
        (s.finished and not s.emitted_finished)
        or (s.num_emitted_tokens == 0 and s.token_ids)
        or len(s.token_ids) - s.num_emitted_tokens >= parent.stream_interval
        for s in parent.samples
    )


def _sent_once(parent: ParentState, name: str, delta: bool, with_samples: bool) -> object:
    """The parent's prompt-level output `name`; a DELTA stream carries it once, in the first
    output with samples once it is there (`<name>_sent` records that)."""
    value = getattr(parent, name)
    if not delta:
        return value
    if getattr(parent, name + "_sent"):
        return None
    if value is not None and with_samples:
        setattr(parent, name + "_sent", True)
    return value


def _parent_stats(parent: ParentState) -> tuple[int, int]:
    """A user request's n, and the most tokens one of its samples generated."""
    return len(parent.samples), max((len(s.token_ids) for s in parent.samples), default=0)
