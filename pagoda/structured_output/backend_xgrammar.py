"""xgrammar (vLLM's default structured-output backend) over Pagoda's tokenizer.

`XgrammarBackend` builds one `xgrammar.TokenizerInfo` from the token bytes (`vocab.py`), with
the engine's EOS as the token that ends a matched grammar, and compiles each distinct
`StructuredOutputsParams` once (cached by its key), or caches one that a compile worker process
compiled (`compile_worker.py`: `compile_constraint` runs there, over a TokenizerInfo made from
the same `tokenizer_info_args`, and the grammar comes back as xgrammar's JSON). A
`GrammarState` is one request's `GrammarMatcher`: it fills that request's row of the
next-token bitmask and accepts each sampled token, each within the request's time budget
(`budget_s`, see the manager). xgrammar is imported here only, when the first structured
request arrives.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.filler import too_slow_message
from pagoda.structured_output.vocab import token_bytes

# Compiled grammars kept for reuse: at most this many, and this many bytes in all (one with a
# 20,000-value enum takes ~100 MB; the least recently used go first).
_CACHE_SIZE = 256
_CACHE_BYTES = 512 << 20
_XGR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: ")


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(
            "structured outputs need the xgrammar package: pip install xgrammar"
        ) from e
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher. `accept_token` returns True when the request must stop: the
    grammar terminated (its stop token was accepted) or rejected the token, or advancing took
    longer than `budget_s` (then `error` says so). Never used by two threads at once: a fill
    the step loop stopped waiting for (`filler.MaskFiller`) ends its request, whose matcher
    nobody touches again."""

    def __init__(self, matcher: Any, budget_s: float = float("inf")) -> None:
        self.matcher = matcher
        self.budget_s = budget_s
        self.rejected = False
        self.error: str | None = None

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return True
        start = time.perf_counter()
        accepted = self.matcher.accept_token(token_id)
        if time.perf_counter() - start > self.budget_s:
            self.error = too_slow_message("to advance past one token", self.budget_s)
            return True
        if not accepted:
            self.rejected = True
            return True
        return self.matcher.is_terminated()

    def is_terminated(self) -> bool:
        return self.rejected or self.matcher.is_terminated()


def tokenizer_info_args(
    tokenizer: Any, vocab_size: int, eos_token_id: int | None
) -> tuple[list[bytes], int, list[int] | None]:
    """The arguments of `make_tokenizer_info` (after xgrammar) for the model's vocabulary: each
    id's bytes, the vocabulary's size, the token that ends a matched grammar. A compile worker
    process builds its TokenizerInfo from the same ones: xgrammar checks that they match when
    it reads a grammar compiled there."""
    stop = [eos_token_id] if eos_token_id is not None else None
    return token_bytes(tokenizer, vocab_size), vocab_size, stop


class XgrammarBackend:
    """`info_args`: `tokenizer_info_args(tokenizer, vocab_size, eos_token_id)`, when already
    made."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        info_args: tuple[list[bytes], int, list[int] | None] | None = None,
    ) -> None:
        self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        if info_args is None:
            info_args = tokenizer_info_args(tokenizer, vocab_size, eos_token_id)
        self.info_args = info_args
        self.tokenizer_info = make_tokenizer_info(self.xgr, *info_args)
        self.compiler = make_compiler(self.xgr, self.tokenizer_info)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the serving loop's compile pool caches from its threads

    @property
    def can_deserialize(self) -> bool:
        """Whether a grammar compiled in another process can be brought here (xgrammar has had
        `CompiledGrammar.serialize_json` since 0.1.2x)."""
        return hasattr(self.xgr.CompiledGrammar, "deserialize_json")

    def deserialize(self, data: str) -> Any:
        """A grammar compiled by a worker process (`serialize_json`), over this TokenizerInfo."""
        return self.xgr.CompiledGrammar.deserialize_json(data, self.tokenizer_info)

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.cache_key() in self._compiled

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for `params` (cached); ValueError naming what is wrong. Any
        thread: xgrammar compiles without the GIL."""
        key = params.cache_key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = compile_constraint(self.compiler, params)
        self.put(params, compiled)
        return compiled

    def put(self, params: StructuredOutputsParams, compiled: Any) -> None:
        """Cache `compiled` as the grammar of `params` (the most recently used)."""
        key = params.cache_key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
            else:
                self._compiled[key] = compiled
                self._cached_bytes += _size(compiled)
            while len(self._compiled) > 1 and (
                len(self._compiled) > _CACHE_SIZE or self._cached_bytes > _CACHE_BYTES
            ):
                self._cached_bytes -= _size(self._compiled.popitem(last=False)[1])

    def new_state(
        self, params: StructuredOutputsParams, budget_s: float = float("inf")
    ) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(self.compile(params)), budget_s)


def make_tokenizer_info(
    xgr: Any, encoded_vocab: list[bytes], vocab_size: int, stop_token_ids: list[int] | None
) -> Any:
    """The TokenizerInfo of the model's vocabulary: each id's bytes, matched raw."""
    return xgr.TokenizerInfo(
        encoded_vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


def make_compiler(xgr: Any, tokenizer_info: Any) -> Any:
    # The cache is ours (XgrammarBackend's, bounded); xgrammar's own would grow without bound.
    return xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)


def compile_constraint(compiler: Any, params: StructuredOutputsParams) -> Any:
    """`params` compiled by `compiler` (an xgrammar GrammarCompiler), or a ValueError naming what
    is wrong with it. Any thread: xgrammar compiles without the GIL."""
    try:
        return _compile(compiler, params)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar reports bad specs as RuntimeError
        kind = next(
            k
            for k in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(params, k) is not None
        )
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        # Drop xgrammar's "[time] file.cc:line: " prefix; keep what it says is wrong.
        msg = _XGR_PREFIX.sub("", lines[0]) if lines else type(e).__name__
        raise ValueError(f"invalid structured_outputs.{kind}: {msg}") from None


def check_constraint(p: StructuredOutputsParams) -> dict[str, Any] | None:
    """Refuse, with compile's ValueError, what is wrong with `p` that no grammar compiler is
    needed to see: a whitespace_pattern (xgrammar has none), a schema given as text that is
    not JSON or not an object. Input processing calls it before a server admits the request,
    so that such a constraint is a 400 at any load; a regex or grammar that does not parse, a
    schema feature xgrammar lacks, only the compile finds (docs/reliability.md: why that
    cannot come before admission). Returns the JSON schema as a dict where `p.json` is set."""
    if p.whitespace_pattern is not None:
        raise ValueError(
            "structured_outputs.whitespace_pattern is not supported by the xgrammar backend"
        )
    schema = p.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"invalid structured_outputs.json: not JSON ({e})") from None
    if schema is not None and not isinstance(schema, dict):
        raise ValueError("invalid structured_outputs.json: a schema must be an object")
    return schema


def _compile(c: Any, p: StructuredOutputsParams) -> Any:
    schema = check_constraint(p)
    if schema is not None:
        if p.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return c.compile_json_schema(
            json.dumps(schema), any_whitespace=not p.disable_any_whitespace
        )
    if p.json_object:
        return c.compile_builtin_json_grammar()
    if p.regex is not None:
        return c.compile_regex(p.regex)
    if p.choice is not None:
        return c.compile_grammar(choice_grammar(p.choice))
    assert p.grammar is not None
    return c.compile_grammar(p.grammar)


def _size(compiled: Any) -> int:
    return int(getattr(compiled, "memory_size_bytes", 0))


def _no_additional_properties(schema: Any) -> Any:
    """A copy of the schema with additionalProperties false on every object (vLLM's option)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out
