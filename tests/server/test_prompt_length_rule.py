"""One prompt-length rule, one message: a prompt must leave room for a generated token, so one
of exactly max_model_len tokens is refused alike by `LLM.generate`, `AsyncLLM.generate` and the
HTTP server (all running `validate_request`), and one token shorter is served."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from model_testing import TINY_CONFIG

from pagoda import LLM, SamplingParams
from pagoda.engine.async_llm import AsyncLLM
from pagoda.sampling_params import RequestOutputKind
from pagoda.server.app import build_app

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return LLM(
        str(path), load_format="dummy", skip_tokenizer_init=True, max_model_len=MAX_LEN, seed=0
    )


def test_one_rule_and_one_message_for_llm_async_llm_and_the_server(llm) -> None:
    too_long, longest = [1] * MAX_LEN, [1] * (MAX_LEN - 1)
    with pytest.raises(ValueError) as offline:
        llm.generate({"prompt_token_ids": too_long}, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": longest}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1  # the one token there is room for

    served = AsyncLLM(llm.llm_engine)  # the same engine core, on the core loop's thread
    try:

        async def generate(ids: list[int]) -> list:
            params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
            return [o async for o in served.generate(ids, params, f"r{len(ids)}")]

        with pytest.raises(ValueError) as asynchronous:
            asyncio.run(generate(too_long))
        assert asyncio.run(generate(longest))[-1].finished

        with TestClient(build_app(served)) as client:
            r = client.post("/v1/completions", json={"prompt": too_long})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            http = r.json()["error"]["message"]
            r = client.post("/v1/completions", json={"prompt": longest, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 1
    finally:
        served.shutdown()
    message = str(offline.value)
    assert "maximum context length is 64 tokens, but the prompt has 64 tokens" in message
    assert str(asynchronous.value) == message == http
