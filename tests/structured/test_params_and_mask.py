"""StructuredOutputsParams checks, the token bytes given to xgrammar, and the torch bitmask vs
xgrammar's own."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams, StructuredOutputsParams
from pagoda.sample.bitmask import apply_token_bitmask, unpack_bitmask, unpack_bitmask_reference

xgr = pytest.importorskip("xgrammar")


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert p.clone().structured_outputs == p.structured_outputs
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.tokenizer import get_tokenizer

    mc = EngineArgs().create_engine_config().model_config
    return get_tokenizer(mc.tokenizer or mc.model), mc.vocab_size


def test_token_bytes_spell_the_text(tokenizer):
    from pagoda.structured_output.vocab import token_bytes

    tok, vocab_size = tokenizer
    vocab = token_bytes(tok, vocab_size + 7)  # a padded embedding: the extra ids are empty
    assert len(vocab) == vocab_size + 7 and vocab[-1] == b""
    for text in ['{"a": [1, 2.5e-3]}\n\t', "héllo 你好 🙂", "  two  spaces"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(vocab[i] for i in ids) == text.encode()
    for i in tok.all_special_ids:
        assert vocab[i] == b""


@pytest.mark.parametrize("rows", [[0, 1, 2], [3, 0], [2]])
def test_bitmask_matches_xgrammar(rows):
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32
    logits = torch.randn(4, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), 4), dtype=torch.int32, generator=g)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    full = torch.full((4, 4), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(ref, full, indices=rows)
    assert torch.equal(ours, ref)
    assert (
        torch.isinf(ours[rows]).any()
        and not torch.isinf(ours[[r for r in range(4) if r not in rows]]).any()
    )


@pytest.mark.parametrize("vocab", [64, 100, 200])
def test_unpack_matches_reference(vocab):
    g = torch.Generator().manual_seed(1)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # all allowed
    bitmask[1] = 0  # none
    fast, ref = unpack_bitmask(bitmask, vocab), unpack_bitmask_reference(bitmask, vocab)
    assert fast.shape == (3, vocab) and torch.equal(fast, ref)
    assert fast[0, :128].all() and not fast[1].any() and not fast[:, 128:].any()


def test_xgrammar_is_imported_only_for_structured_requests():
    import subprocess
    import sys

    code = (
        "import sys; import pagoda.engine.llm_engine, pagoda.worker.model_runner, "
        "pagoda.server.serving; assert 'xgrammar' not in sys.modules, 'imported'\n"
        "sys.modules['xgrammar'] = None  # not installed\n"
        "from pagoda.structured_output import StructuredOutputManager\n"
        "from pagoda import SamplingParams\n"
        "m = StructuredOutputManager(object(), 10, 0)\n"
        "try:\n"
        "    m.validate(SamplingParams(structured_outputs={'choice': ['a']}))\n"
        "except ValueError as e:\n"
        "    assert 'pip install xgrammar' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensor_parallel_is_refused_clearly():
    from types import SimpleNamespace

    from pagoda.engine.core import EngineCore

    engine = EngineCore.__new__(EngineCore)  # only the check, without a model
    engine.config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        engine._check_structured_outputs(SamplingParams(structured_outputs={"regex": "a"}))


def test_without_a_tokenizer_a_constraint_is_refused_clearly():
    from pagoda.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(None, 10, 0)  # skip_tokenizer_init
    for call in (manager.compile_worker_args, lambda: manager.backend):
        with pytest.raises(ValueError, match="do not use skip_tokenizer_init"):
            call()
