"""Default sampling parameters from a Hugging Face model's generation_config.json, as vLLM
takes them (`ModelConfig.get_diff_sampling_param`): `LLM.generate`/`chat` without
SamplingParams, and the OpenAI server for the request fields a client leaves unset, sample with
the model creator's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
(as max_tokens). `generation_config` is vLLM's `--generation-config`: "auto" (the model's
folder), "vllm" (ignore it: SamplingParams' own defaults) or a folder holding one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagoda.logger import init_logger

logger = init_logger(__name__)

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# The keys of generation_config.json that set default sampling parameters, as vLLM reads them,
# under SamplingParams' names.
_GENERATION_CONFIG_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def check_generation_config(value: str) -> None:
    """A ValueError naming the flag unless `value` is "auto", "vllm" or a folder."""
    if value not in GENERATION_CONFIG_CHOICES and not os.path.isdir(value):
        raise ValueError(
            f"generation_config (--generation-config) must be 'auto' (the model's "
            f"generation_config.json), 'vllm' (ignore it) or a folder holding a "
            f"generation_config.json, got {value!r}"
        )


def get_diff_sampling_param(
    model: str, generation_config: str = "auto", log: bool = True
) -> dict[str, Any]:
    """The sampling parameters the generation_config.json of `model` (a folder; "auto") or of
    the folder `generation_config` sets, under SamplingParams' names; {} for "vllm", a GGUF
    file or a folder without one. Values SamplingParams refuses are a ValueError naming the
    file, at start-up rather than in every request. `log`: log the parameters it found."""
    from pagoda.sampling_params import SamplingParams

    check_generation_config(generation_config)
    if generation_config == "vllm":
        return {}
    folder = model if generation_config == "auto" else generation_config
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    params = {
        name: config[key]
        for key, name in _GENERATION_CONFIG_KEYS.items()
        if config.get(key) is not None
    }
    try:
        SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e} (--generation-config vllm ignores it)") from None
    if params and log:
        logger.info(
            "Default sampling parameters have been overridden by the model's Hugging Face "
            "generation config (%s): %s. If this is not intended, relaunch with "
            "`--generation-config vllm` (LLM(generation_config='vllm')).",
            path,
            params,
        )
    return params
