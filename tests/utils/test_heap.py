"""An engine's start-up heap is frozen out of full garbage collections, and what an earlier
engine left frozen is collectable again once that engine is gone."""

from __future__ import annotations

import gc
import json
import weakref

from pagoda.utils.heap import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_hides_the_heap_and_releases_an_earlier_one() -> None:
    try:
        first = _Cycle()
        gone = weakref.ref(first)
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        del first
        gc.collect()
        assert gone() is not None  # frozen: a full collection does not see the cycle
        freeze_startup_heap()  # the next engine's start-up
        assert gone() is None
    finally:
        gc.unfreeze()


def test_llm_engine_freezes_after_start_up(monkeypatch, tmp_path) -> None:
    from model_testing import TINY_CONFIG

    import pagoda.engine.core as engine_core
    from pagoda import LLM

    calls = []
    monkeypatch.setattr(engine_core, "freeze_startup_heap", lambda: calls.append(1))
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    assert calls == [1] and llm.llm_engine.num_blocks > 0
