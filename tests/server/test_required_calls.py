"""`tool_choice: "required"` streamed: `RequiredCallsStream` against the unstreamed calls
(`tool_calls_from_text`) in every chunking, and what a stream cut short sends."""

from __future__ import annotations

import random

import pytest

from pagoda.server.required_calls import RequiredCallsStream, calls_read_so_far
from pagoda.server.serving_chat import _ToolDeltas
from pagoda.server.tool_choice import ToolChoice, tool_calls_from_text

REQUIRED = ToolChoice("required", schema={"type": "array"})

OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    # whitespace, nesting, numbers written otherwise than json.dumps writes them, literals,
    # escapes (\\u, a surrogate pair, \\/, control characters, quote, backslash), empty object
    '[ {"name":"a","parameters":{ "x" : [1, 2.50, -0, 1e2, true, null, {"y": '
    '"\\u00e9\\ud83d\\ude00\\/\\n\\"q\\\\"}] , "z":{} } } ,\n {"name": "b", "parameters": {}} ]',
    '[{"parameters": {"k": "v", "name": "not the call\'s"}, "name": "late"}]',  # name after
    '[{"name": "t\\u0041b", "parameters": {"s": "tab\\tend \\ud800x", "n": -12.5e-3}}]',
]


def _stream(text: str, sizes: list[int]) -> list[dict]:
    calls, out, i = RequiredCallsStream(), [], 0
    for n in sizes:
        out += calls.feed(text[i : i + n])
        i += n
    return out + calls.feed(text[i:], final=True)


def _merged(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function"
            assert d["id"].startswith("chatcmpl-tool-")
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_calls_add_up_to_the_unstreamed_ones(text: str) -> None:
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in _calls(text)]
    rng = random.Random(0)
    chunkings = [[1] * len(text), [len(text)]] + [
        [rng.randint(1, 8) for _ in range(len(text))] for _ in range(20)
    ]
    for sizes in chunkings:
        assert _merged(_stream(text, sizes)) == want, sizes


def _calls(text: str) -> list[dict]:
    calls = tool_calls_from_text(REQUIRED, text)
    assert calls is not None
    return calls


def test_a_call_goes_out_once_its_name_is_whole_then_its_arguments() -> None:
    calls = RequiredCallsStream()
    assert calls.feed('[{"name": "get_wea') == [] and not calls.started
    (first,) = calls.feed('ther", "parameters": {"ci')
    assert first["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert calls.feed('ty": "Pa') == [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]
    assert calls.feed("ris") == [{"index": 0, "function": {"arguments": "ris"}}]
    closing, second = calls.feed('"}}, {"name": "b"')
    assert closing == {"index": 0, "function": {"arguments": '"}'}}
    assert second["index"] == 1 and second["function"] == {"name": "b", "arguments": ""}
    assert calls.feed(', "parameters": { }}]', final=True) == [
        {"index": 1, "function": {"arguments": "{}"}}
    ]


def test_a_stream_cut_short_before_a_name_sends_its_text_as_content() -> None:
    deltas = _ToolDeltas(REQUIRED, None, logprobs=False)
    assert deltas.delta(0, '[{"na', False) is None
    last = deltas.delta(0, 'me": "get', True)
    assert last is not None and last.content == '[{"name": "get' and not last.tool_calls
    # With logprobs every chunk goes out (its logprobs with it), empty until a name is whole.
    deltas = _ToolDeltas(REQUIRED, None, logprobs=True)
    assert deltas.delta(0, "[{", False) is not None
    cut = deltas.delta(0, '"name": "b", "parameters": {"x": 1', True)
    assert cut is not None and cut.tool_calls and not cut.content
    assert cut.tool_calls == [  # one delta a call, with the number that ended the output
        {"index": 0, "id": cut.tool_calls[0]["id"], "type": "function",
         "function": {"name": "b", "arguments": '{"x": 1'}}
    ]  # fmt: skip


@pytest.mark.parametrize("text", OUTPUTS)
def test_an_output_cut_anywhere_gives_unstreamed_what_its_stream_gave(text: str) -> None:
    for end in range(len(text) + 1):
        cut = text[:end]
        calls = calls_read_so_far(cut)
        assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert got == _merged(_stream(cut, [1] * len(cut))), cut
