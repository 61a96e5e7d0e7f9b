"""Variant of run 82: after each layer's MLP, the next layer's qkv_proj weights are asked into
L2 too (on PYTHONPATH, patched into the engine's processes)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../../..")))
import pagoda.model.models.llama as llama  # noqa: E402
from pagoda.kernels.l2_prefetch import WeightPrefetch  # noqa: E402

_init, _forward = llama.LlamaModel.__init__, llama.LlamaDecoderLayer.forward


def __init__(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    layers = list(self.layers)
    for cur, nxt in zip(layers, layers[1:]):
        cur.after_mlp = WeightPrefetch(lambda n=nxt: [n.self_attn.qkv_proj])


def forward(self, *args, **kwargs):
    out, residual = _forward(self, *args, **kwargs)
    prefetch = getattr(self, "after_mlp", None)
    if prefetch is not None:
        prefetch(out)
    return out, residual


llama.LlamaModel.__init__ = __init__
llama.LlamaDecoderLayer.forward = forward
