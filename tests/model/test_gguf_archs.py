"""GGUF files of Gemma 2, Gemma 3 (text) and Phi-3, written from a tiny transformers model with
the gguf package as llama.cpp's convert_hf_to_gguf.py writes them (its GGUFWriter calls, tensor
names, Gemma's norms stored as 1 + weight, Phi-3's fused tensors and LongRoPE factor tensors):
Pagoda's logits from the file against transformers' own, a greedy run through `LLM`, and the
errors for keys a file lacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import PagedRunner, make_tiny_checkpoint

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model

gguf = pytest.importorskip("gguf")

_GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
# Overrides a GGUF file can carry: it has no query_pre_attn_scalar (llama.cpp uses head_dim)
# and Gemma 3's files hold no layer pattern (llama.cpp's: every 6th layer global).
CASES = {
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    "gemma3": (
        "gemma3",
        dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=_GEMMA3_LAYERS),
    ),
    "phi3": ("phi3", {}),
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused gate and up
    "mlp.down_proj": "ffn_down",
}


def _write_metadata(w, c, arch: str) -> None:
    """The keys the converter's set_gguf_parameters writes for `arch`."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(0)  # all F32
    rope = c.rope_parameters
    if arch == "gemma2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    elif arch == "gemma3":
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
    else:  # phi3
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size)
        w.add_rope_dimension_count(rope_dims // c.num_attention_heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{kind}.weight", factors)
    # The converters write the tokenizer's vocabulary; its length is the vocabulary size.
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)


def _write_gguf(hf, path: str, arch: str, drop: str | None = None) -> None:
    """Write `hf` as llama.cpp's converter would, leaving out the metadata key `drop`."""
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    _write_metadata(w, c, arch)
    if drop is not None:
        del w.kv_data[0][drop]
    gemma = arch.startswith("gemma")
    for name, t in hf.state_dict().items():
        t = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            t = t + 1  # Gemma's RMSNorm scales by 1 + weight; the converter stores that sum
        if name == "lm_head.weight":
            if not gemma:  # Gemma's head is the embedding; the converter skips the copy
                w.add_tensor("output.weight", t)
        elif name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            module = rest.rsplit(".", 1)[0]
            if module == "post_attention_layernorm":
                gguf_name = "post_attention_norm" if gemma else "ffn_norm"
            else:
                gguf_name = _LAYER_NAMES[module]
            w.add_tensor(f"blk.{layer}.{gguf_name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(tmp_path, arch: str):
    case, overrides = CASES[arch]
    hf = make_tiny_checkpoint(tmp_path / "hf", case, **overrides)
    path = str(tmp_path / "model.gguf")
    _write_gguf(hf, path, arch)
    return hf, path


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_logits_match_transformers(tmp_path, arch):
    hf, path = _tiny(tmp_path, arch)
    cfg = get_model_config_dict(path)
    assert cfg["architectures"] == [type(hf).__name__]
    model = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=64))
    tokens = list(range(5, 35))  # longer than every sliding window of the tiny models
    logits = PagedRunner(model, cfg, num_blocks=16).step(tokens, 0)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    assert (logits - want).abs().max().item() < 1e-3


def test_gguf_config_reads_gemma_keys(tmp_path):
    hf, path = _tiny(tmp_path, "gemma2")
    cfg = get_model_config_dict(path)
    assert cfg["attn_logit_softcapping"] == hf.config.attn_logit_softcapping
    assert cfg["final_logit_softcapping"] == hf.config.final_logit_softcapping
    assert cfg["sliding_window"] == hf.config.sliding_window
    assert cfg["layer_types"] == hf.config.layer_types
    assert cfg["tie_word_embeddings"] is True


def test_llm_greedy_run_of_gemma3_gguf_matches_transformers(tmp_path):
    from pagoda import LLM, SamplingParams

    hf, path = _tiny(tmp_path, "gemma3")
    prompt, steps = list(range(3, 23)), 8
    want = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want[len(prompt) :]


@pytest.mark.parametrize(
    "arch,key",
    [("gemma2", "gemma2.attention.sliding_window"),
     ("gemma3", "gemma3.feed_forward_length"),
     ("phi3", "phi3.rope.scaling.original_context_length")],
)  # fmt: skip
def test_missing_required_key_is_named(tmp_path, arch, key):
    case, overrides = CASES[arch]
    hf = make_tiny_checkpoint(tmp_path / "hf", case, **overrides)
    path = str(tmp_path / "model.gguf")
    _write_gguf(hf, path, arch, drop=key)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        get_model_config_dict(path)
