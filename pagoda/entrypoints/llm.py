"""`LLM`: offline batched generation and chat, the vLLM Python API users already know."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pagoda.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagoda.engine.arg_utils import EngineArgs, legacy_speculative_config
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.entrypoints.chat_utils import normalize_messages
from pagoda.generation_config import get_diff_sampling_param
from pagoda.logger import init_logger
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

# vLLM arguments that select features Pagoda does not have: their defaults are accepted (code
# written for vLLM passes them), anything else is refused saying so.
_NO_LORA = "Pagoda has no LoRA adapters (merge the adapter into the checkpoint instead)"
_UNSUPPORTED_INIT: dict[str, tuple[tuple[Any, ...], str]] = {
    "lora_modules": ((None,), _NO_LORA),
    "enable_lora": ((None, False), _NO_LORA),
    "task": ((None, "auto", "generate"), "Pagoda runs generative models only"),
}
_UNSUPPORTED_REQUEST: dict[str, str] = {
    "lora_request": _NO_LORA,
    "prompt_adapter_request": "Pagoda has no prompt adapters",
    "guided_options_request": (
        "give structured outputs as SamplingParams(structured_outputs=StructuredOutputsParams(...))"
    ),
    "mm_processor_kwargs": "Pagoda runs text-only models",
}
_NO_POOLING = (
    "Pagoda runs generative models only (LLM.generate, LLM.chat): embedding, classification "
    "and scoring models are not supported"
)


def _refuse_unsupported(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        # vLLM takes one per prompt too: a list of Nones is the default as well.
        if value is not None and not (
            isinstance(value, (list, tuple)) and all(v is None for v in value)
        ):
            raise ValueError(f"{name} is not supported: {_UNSUPPORTED_REQUEST[name]}")


class _Tokenization:
    """vLLM's `tokenization_kwargs` applied to one prompt: its text tokenized with or without
    special tokens, then its ids truncated to `truncate_prompt_tokens` (or `max_length` with
    `truncation`; -1 or no max_length: the context less one token) from `truncation_side`
    ("left" keeps the last tokens, as vLLM's default for generation). Other keys are logged
    and ignored, as vLLM does."""

    def __init__(self, kwargs: dict[str, Any], add_special_tokens: bool) -> None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"tokenization_kwargs must be a dict, got {type(kwargs).__name__}")
        kw = dict(kwargs)
        self.add_special_tokens = kw.pop("add_special_tokens", add_special_tokens)
        max_length = kw.pop("max_length", -1)
        self.keep = kw.pop("truncate_prompt_tokens", None)
        truncation = kw.pop("truncation", None)
        if truncation in (True, "longest_first"):
            self.keep = max_length
        elif truncation not in (None, False, "do_not_truncate"):
            raise ValueError(f"tokenization_kwargs truncation={truncation!r} is not supported")
        self.side = kw.pop("truncation_side", None) or "left"
        if self.side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.side!r}")
        if self.keep is not None and (
            isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < -1
        ):
            raise ValueError(f"the number of prompt tokens to keep must be >= -1, got {self.keep}")
        if not isinstance(self.add_special_tokens, bool):
            raise ValueError("tokenization_kwargs add_special_tokens must be true or false")
        if kw:
            logger.warning("tokenization_kwargs ignored (not supported): %s", sorted(kw))

    def __call__(self, engine: LLMEngine, prompt: Any) -> Any:
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if text is not None:
            ids = engine.input_processor.encode(text, add_special_tokens=self.add_special_tokens)
        elif isinstance(prompt, dict):
            ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        else:
            ids = prompt
        keep = engine.model_config.max_model_len - 1 if self.keep == -1 else self.keep
        if keep is not None and isinstance(ids, (list, tuple)) and len(ids) > keep:
            ids = ids[len(ids) - keep :] if self.side == "left" else ids[:keep]
        out: dict[str, Any] = {"prompt_token_ids": list(ids)}
        if text is not None:
            out["prompt"] = text
        return out


def _not_implemented(method: str, what_instead: str) -> NoReturn:
    raise NotImplementedError(f"LLM.{method}() is not implemented by Pagoda: {what_instead}")


class LLM:
    """Generate text from prompts with continuous batching over a paged KV cache.

    `LLM()` runs the embedded SmolLM2-135M-Instruct; `LLM(model=PATH)` takes a Hugging Face
    directory or a .gguf file. Keyword arguments are `EngineArgs` fields (vLLM's names).
    Calls from several threads run one at a time (one engine steps one batch).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        for name, (accepted, reason) in _UNSUPPORTED_INIT.items():
            value = kwargs.pop(name, None)
            if value not in accepted:
                raise ValueError(f"{name}={value!r} is not supported: {reason}")
        legacy = legacy_speculative_config(kwargs)
        if legacy is not None:
            if kwargs.get("speculative_config") is not None:
                raise ValueError("give speculative_config or speculative_model, not both")
            kwargs["speculative_config"] = legacy
        kwargs.setdefault("disable_log_stats", True)
        fields = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self._default_sampling_params: dict[str, Any] | None = None
        if model is not None:  # a bad generation_config.json fails here, before the model loads
            self._default_sampling_params = get_diff_sampling_param(
                model, self.engine_args.generation_config
            )
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()
        self._lock = threading.RLock()  # generate / chat from several threads: one at a time

    @property
    def model_config(self) -> Any:
        """The engine's model configuration (vLLM's `llm.model_config`: max_model_len, ...)."""
        return self.llm_engine.model_config

    def get_tokenizer(self):  # noqa: ANN201 - pagoda.tokenizer.Tokenizer
        """The model's tokenizer, with the methods and defaults of a transformers tokenizer
        (what vLLM returns here), apply_chat_template's included (tokenize=True,
        add_generation_prompt=False)."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens) over SamplingParams' defaults, as vLLM reads it
        (`generation_config`: "auto", "vllm" to ignore it, or another folder)."""
        if self._default_sampling_params is None:
            self._default_sampling_params = get_diff_sampling_param(
                self.llm_engine.model_config.model, self.engine_args.generation_config
            )
        return SamplingParams(**self._default_sampling_params)

    def reset_prefix_cache(self, device: Any = None) -> bool:
        """Forget every cached prompt prefix (e.g. between benchmark runs); False (nothing
        done) while a request still holds KV blocks. `device` is vLLM's and is ignored."""
        with self._lock:
            return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
        *,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        guided_options_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; `sampling_params` None samples with
        `get_default_sampling_params()`. `use_tqdm` is a bool or, as in vLLM, a tqdm-like
        factory to make the progress bar with. `priority` is one value for every prompt or
        one per prompt. `tokenization_kwargs` takes vLLM's keys `add_special_tokens`,
        `truncate_prompt_tokens`, `truncation` with `max_length`, and `truncation_side`
        (default "left": the last tokens are kept). vLLM's LoRA, prompt-adapter,
        guided-options and multimodal arguments are accepted as None only."""
        _refuse_unsupported(
            lora_request=lora_request,
            prompt_adapter_request=prompt_adapter_request,
            guided_options_request=guided_options_request,
            mm_processor_kwargs=mm_processor_kwargs,
        )
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                "prompts must be a string, a list of token ids, a dict or a list of these, "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params must be one object or one per prompt")
        for p in params_list:
            if not isinstance(p, SamplingParams):
                raise TypeError(
                    f"sampling_params must be SamplingParams objects, got {type(p).__name__}"
                )
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        elif priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must be one value or one per prompt")
        if tokenization_kwargs is not None:
            tokenize = _Tokenization(tokenization_kwargs, add_special_tokens=True)
            prompts = [tokenize(self.llm_engine, p) for p in prompts]
        with self._lock:
            return self._generate(prompts, params_list, use_tqdm, priority)

    def _generate(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        use_tqdm: bool | Callable[..., Any],
        priority: list[int] | None,
    ) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._counter))
                self.llm_engine.add_request(
                    rid, prompt, params, priority=priority[i] if priority else 0
                )
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template and complete it (vLLM's arguments,
        in vLLM's order). `continue_final_message` (with add_generation_prompt=False) continues
        the last message instead of starting a new one. Content is rendered as a string (text
        parts joined): chat_template_content_format "openai" is not supported.
        `chat_template_kwargs` keys add_generation_prompt, continue_final_message and tools
        win over the arguments, as in earlier vLLM releases and Pagoda's server (in vLLM
        0.32 the arguments win, even at their defaults, so these keys are ignored there). `tokenization_kwargs` as in `generate`
        (add_special_tokens defaults to False: the template holds the special tokens)."""
        _refuse_unsupported(lora_request=lora_request, mm_processor_kwargs=mm_processor_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r} is not "
                "supported: Pagoda renders message content as a string ('auto' or 'string')"
            )
        if not isinstance(messages, (list, tuple)):
            raise ValueError(
                "messages must be a list of messages ({'role': ..., 'content': ...}) or a list "
                f"of such conversations, got {type(messages).__name__}"
            )
        if not messages:
            return []  # as vLLM: no conversations
        conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict")
        kw = dict(chat_template_kwargs or {})
        # As vLLM (and the server): these arguments given in chat_template_kwargs win.
        add_generation_prompt = kw.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kw.pop("continue_final_message", continue_final_message)
        tools = kw.pop("tools", tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True continues the last message: pass "
                "add_generation_prompt=False with it"
            )
        if tools is not None and not isinstance(tools, list):
            raise ValueError(
                f"tools must be a list of tool definitions, got {type(tools).__name__}"
            )
        tok = self.llm_engine.tokenizer
        tokenize = _Tokenization(tokenization_kwargs or {}, add_special_tokens=False)
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(
                normalize_messages(conv),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                chat_template=chat_template,
                tools=tools,
                **kw,
            )
            # The template already holds the special tokens (BOS etc.): do not add them twice.
            # A conversation too long for the context by its length alone is refused here,
            # before it is tokenized (and before any of the batch runs), as generate does.
            prompts.append(tokenize(self.llm_engine, text))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def _run_engine(
        self, request_ids: list[str], use_tqdm: bool | Callable[..., Any]
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make_pbar = use_tqdm if callable(use_tqdm) else tqdm
            pbar = make_pbar(
                total=len(request_ids),
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
            )
        finished: dict[str, RequestOutput] = {}
        n_in = n_out = 0
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    finished[out.request_id] = out
                    if pbar is not None:
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        pbar.postfix = (
                            f"est. speed input: {n_in / elapsed:.2f} toks/s, "
                            f"output: {n_out / elapsed:.2f} toks/s"
                        )
                        pbar.update(1)
        except BaseException:
            engine.abort_request(list(request_ids))
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[rid] for rid in request_ids if rid in finished]

    # -- vLLM's other LLM methods, for what Pagoda does not do -------------------------------
    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`pagoda.beam_search`): the `params.beam_width` best sequences of
        each prompt (a string, token ids or a TextPrompt / TokensPrompt), each step one engine
        call for every live beam; `concurrency_limit` prompts at a time (all by default)."""
        _refuse_unsupported(lora_request=lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        ids = [self.llm_engine.input_processor.process_prompt(p)[1] for p in prompts]
        limit = concurrency_limit or max(len(ids), 1)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(ids), limit):
            outputs += beam_search(
                ids[start : start + limit], params,
                lambda batch, sp: self.generate(batch, sp, use_tqdm=False),
                self.get_tokenizer(), self.llm_engine.model_config.max_model_len,
            )  # fmt: skip
        return outputs

    def encode(self, *args: Any, **kwargs: Any) -> NoReturn:
        _not_implemented("encode", _NO_POOLING)

    def embed(self, *args: Any, **kwargs: Any) -> NoReturn:
        _not_implemented("embed", _NO_POOLING)

    def classify(self, *args: Any, **kwargs: Any) -> NoReturn:
        _not_implemented("classify", _NO_POOLING)

    def score(self, *args: Any, **kwargs: Any) -> NoReturn:
        _not_implemented("score", _NO_POOLING)

    def start_profile(self) -> NoReturn:
        _not_implemented(
            "start_profile",
            "profile the generate call with torch.profiler.profile() instead",
        )

    def stop_profile(self) -> NoReturn:
        _not_implemented("stop_profile", "see start_profile")

    def get_metrics(self) -> NoReturn:
        _not_implemented(
            "get_metrics",
            "its Prometheus metrics are served at /metrics by `pagoda serve`; offline, "
            "LLM(disable_log_stats=False) logs throughput and cache use",
        )
