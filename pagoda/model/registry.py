"""Architecture name (config.json's `architectures[0]`) -> model class, imported on first use."""

from __future__ import annotations

import importlib

from torch import nn

_LLAMA = "pagoda.model.models.llama"
_GEMMA = "pagoda.model.models.gemma"
_GRANITE = "pagoda.model.models.granite"
_MOE = "pagoda.model.models.moe"
_OLMO2 = "pagoda.model.models.olmo2"

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": (_GEMMA, "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": (_GEMMA, "Gemma3ForCausalLM"),
    "GraniteForCausalLM": (_GRANITE, "GraniteForCausalLM"),
    "LlamaForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "MistralForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "MixtralForCausalLM": (_MOE, "MixtralForCausalLM"),
    "Olmo2ForCausalLM": (_OLMO2, "Olmo2ForCausalLM"),
    "Phi3ForCausalLM": (_LLAMA, "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": (_LLAMA, "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": (_MOE, "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": (_LLAMA, "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": (_MOE, "Qwen3MoeForCausalLM"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    _MODELS[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module), class_name)
