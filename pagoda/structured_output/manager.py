"""`StructuredOutputManager`: the engine's side of structured outputs (vLLM's manager of the same
name). It checks and compiles a request's constraint when it is added (a bad one is a
ValueError there; the serving loop has it compiled in a worker process first,
`compile_pool.py`, and caches the result here), gives each `Request` its own matcher
(`request.structured_output`), and after each `schedule()` fills the bitmask rows of the
scheduled structured requests that sample this step. The matcher must have seen every earlier
token of its request when its row is filled: the engine runs steps with structured requests
synchronously and gives them no drafts.

Applying a constraint has a time budget per token (PAGODA_GRAMMAR_MASK_BUDGET_MS, read when a
request is added): computing its mask (`filler.py`: the step loop waits no longer) and advancing
its matcher past the sampled token (`GrammarState.accept_token`) each take at most that long,
or the request ends with an error and the others go on.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import numpy as np

from pagoda import envs
from pagoda.core.outputs import SchedulerOutput
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.filler import MaskFiller, too_slow_message


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._backend: Any = None
        self._info_args: Any = None
        # The serving loop builds the backend on a worker thread (`compile_pool.py`).
        self._backend_lock = threading.RLock()
        self.filler = MaskFiller()

    @property
    def backend_ready(self) -> bool:
        """Whether any structured request has been seen (only then do steps need a bitmask)."""
        return self._backend is not None

    @property
    def backend(self) -> Any:
        if self._backend is not None:
            return self._backend
        self._check_tokenizer()
        with self._backend_lock:
            if self._backend is None:
                from pagoda.structured_output.backend_xgrammar import XgrammarBackend

                self._backend = XgrammarBackend(
                    self.tokenizer, self.vocab_size, self.eos_token_id, self._info_args
                )
        return self._backend

    def compile_worker_args(self) -> tuple[Any, ...]:
        """What a compile worker process (`compile_worker.py`) needs to build this engine's
        xgrammar TokenizerInfo: the vocabulary's bytes, its size, the stop token. Made once,
        without importing xgrammar (a worker starts while this process imports it)."""
        from pagoda.structured_output import backend_xgrammar as xg

        if self._backend is not None:
            return self._backend.info_args
        self._check_tokenizer()
        if importlib.util.find_spec("xgrammar") is None:
            xg.import_xgrammar()  # its error
        with self._backend_lock:
            if self._info_args is None:
                self._info_args = xg.tokenizer_info_args(
                    self.tokenizer, self.vocab_size, self.eos_token_id
                )
        return self._info_args

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(
                "structured outputs need the tokenizer: do not use skip_tokenizer_init"
            )

    def compiled(self, params: SamplingParams) -> bool:
        """Whether `validate` would return at once: no constraint, one compiled already, or one
        refused before compiling (no tokenizer). The serving loop compiles the others off its
        step loop (`compile_pool.py`) before adding their request; the first one also builds
        the backend there (importing xgrammar took 0.6 s in the engine core process, 2-core
        AMD EPYC)."""
        so = params.structured_outputs
        if so is None or self.tokenizer is None:
            return True
        return self._backend is not None and self._backend.is_cached(so)

    def put_compiled(self, params: SamplingParams, compiled: Any) -> None:
        """Cache the grammar of `params` compiled elsewhere (a compile worker's, read back)."""
        assert params.structured_outputs is not None
        self.backend.put(params.structured_outputs, compiled)

    @property
    def num_abandoned_running(self) -> int:
        """Mask fills given up on (past their budget) that still run, each on a core."""
        return self.filler.num_running_abandoned

    def validate(self, params: SamplingParams) -> None:
        """Compile the request's constraint now (cached): a ValueError if it is invalid."""
        if params.structured_outputs is not None:
            self.backend.compile(params.structured_outputs)

    def init_request(self, request: Request) -> None:
        so = request.sampling_params.structured_outputs
        if so is not None:
            budget_s = envs.PAGODA_GRAMMAR_MASK_BUDGET_MS / 1e3
            request.structured_output = self.backend.new_state(so, budget_s)

    def grammar_bitmask(
        self, sched_out: SchedulerOutput, scheduled: list[Request]
    ) -> dict[str, str]:
        """Fill `sched_out.grammar_bitmask` for the structured requests that sample this step
        (their scheduled tokens reach the end of their known tokens); `scheduled` are the
        step's requests (`Scheduler.scheduled_requests`). Returns {request id: error} for those
        whose mask took longer than their budget: they have no row, and the caller ends them."""
        rids: list[str] = []
        states = []
        for req in scheduled:
            state = req.structured_output
            if state is None or req.num_computed_tokens < req.num_tokens:
                continue
            if req.spec_token_ids or req.num_output_placeholders > 1:
                raise RuntimeError(
                    f"request {req.request_id!r} has structured outputs and tokens the matcher "
                    "has not seen (drafts or tokens in flight)"
                )
            rids.append(req.request_id)
            states.append(state)
        if not rids:
            return {}
        words = -(-self.vocab_size // 32)
        bitmask = np.empty((len(rids), words), dtype=np.int32)
        slow = self.filler.fill(states, bitmask)
        errors = {
            rids[row]: too_slow_message("to compute the next token's mask", states[row].budget_s)
            for row in slow
        }
        if slow:
            keep = [row for row in range(len(rids)) if rids[row] not in errors]
            bitmask, rids = bitmask[keep], [rids[row] for row in keep]
        if rids:
            sched_out.grammar_bitmask = bitmask
            sched_out.structured_output_request_ids = rids
        return errors
