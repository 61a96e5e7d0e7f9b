"""The server samples what a request leaves unset with the model's generation_config.json, as
vLLM's (`--generation-config auto`, the default): temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens); a field the request sets wins;
`--generation-config vllm` ignores the file, a folder reads its own."""

from __future__ import annotations

import json
import logging

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from model_testing import TINY_CONFIG

from pagoda import LLM
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.server.app import build_app
from pagoda.server.cli import make_arg_parser

CONFIG = {"temperature": 0.5, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
          "repetition_penalty": 1.1, "max_new_tokens": 3, "bos_token_id": 1}  # fmt: skip
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
CHAT = [{"role": "user", "content": "hi"}]


class RecordingEngine(FakeEngine):
    """A FakeEngine serving a model folder, keeping each request's SamplingParams."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model_config.model = model
        self.seen: list = []

    def add_requests(self, requests) -> None:
        self.seen += [r.sampling_params for r in requests]
        super().add_requests(requests)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def _post(model: str, route: str, body: dict, generation_config: str = "auto") -> dict:
    """The SamplingParams the engine got for `body`, as a dict of FIELDS."""
    engine = RecordingEngine(model)
    llm = AsyncLLM(engine)
    try:
        with TestClient(build_app(llm, generation_config=generation_config)) as client:
            resp = client.post(route, json=body)
            assert resp.status_code == 200, resp.text
    finally:
        llm.shutdown()
    (params,) = engine.seen
    return {f: getattr(params, f) for f in FIELDS}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": None}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ],
)
def test_unset_fields_take_the_generation_config(model_dir, route, body, stream):
    got = _post(str(model_dir), route, {**body, "stream": stream})
    assert got == {"temperature": 0.5, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                   "repetition_penalty": 1.1, "max_tokens": 3}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5}),
    ],
)
def test_fields_the_request_sets_win(model_dir, route, body, stream):
    set_fields = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "repetition_penalty": 1.0}  # fmt: skip
    got = _post(str(model_dir), route, {**body, **set_fields, "stream": stream})
    assert got == {**set_fields, "max_tokens": 5}


def test_completions_keep_openais_max_tokens_default(model_dir):
    # As vLLM: a completion request's max_tokens defaults to 16 (OpenAI's), so only an
    # explicit null leaves it to the generation config.
    assert _post(str(model_dir), "/v1/completions", {"prompt": "hello"})["max_tokens"] == 16


def test_the_config_max_tokens_is_cut_to_the_context(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 10_000}))
    got = _post(str(tmp_path), "/v1/chat/completions", {"messages": CHAT})
    assert got["max_tokens"] < 128  # the rest of FakeEngine's context, not a 400


def test_generation_config_vllm_ignores_it(model_dir):
    got = _post(str(model_dir), "/v1/chat/completions", {"messages": CHAT}, "vllm")
    assert got["temperature"] == 1.0 and got["top_p"] == 1.0 and got["top_k"] == 0
    assert got["max_tokens"] > 3  # the rest of the context


def test_generation_config_folder_is_read_instead_of_the_models(model_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    got = _post(str(other), "/v1/chat/completions", {"messages": CHAT}, str(model_dir))
    assert got["top_k"] == 20 and got["max_tokens"] == 3
    assert _post(str(other), "/v1/chat/completions", {"messages": CHAT})["top_k"] == 0


def test_generation_config_flag(model_dir):
    parse = make_arg_parser().parse_args
    assert EngineArgs.from_cli_args(parse([])).generation_config == "auto"
    args = parse(["--generation-config", "vllm"])
    assert EngineArgs.from_cli_args(args).generation_config == "vllm"
    args = parse(["--generation-config", str(model_dir / "missing")])
    with pytest.raises(ValueError, match="--generation-config"):
        EngineArgs.from_cli_args(args).check_model_config()


def test_a_dummy_weight_model_folder_serves_with_its_generation_config(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(logging.getLogger("pagoda"), "propagate", True)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    served = AsyncLLM(llm.llm_engine)
    try:
        with caplog.at_level("INFO", logger="pagoda"), TestClient(build_app(served)) as client:
            body = {"prompt": [1, 2, 3], "max_tokens": None, "ignore_eos": True}
            usage = client.post("/v1/completions", json=body).json()["usage"]
            assert usage["completion_tokens"] == 2
            usage = client.post("/v1/completions", json={**body, "max_tokens": 4}).json()["usage"]
            assert usage["completion_tokens"] == 4
        assert "overridden by the model's Hugging Face generation config" in caplog.text
    finally:
        served.shutdown()
