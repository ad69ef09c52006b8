"""The OpenAI-compatible endpoint (`workbench serve --http`), from a separate server process:
the official `openai` client, error objects, SSE, disconnect -> abort, Prometheus /metrics, and a
64-stream load from yet another process. Pure mapping code is tested without a server first."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from http_helpers import MAX_LEN, ROOT, shared_server, stop_process

from workbench.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompts,
    decode_request,
    sampling_params,
)
from workbench.http.server import parse_host_port
from workbench.http.structured import constraint_of, tool_plan
from workbench.sampling_params import StructuredOutput

openai = pytest.importorskip("openai")


# -- no server ------------------------------------------------------------------------------------
def test_prompt_forms_and_params():
    assert completion_prompts("hi") == ["hi"]
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "a"], [[1], []], 5, None, [True]):
        with pytest.raises(APIError) as e:
            completion_prompts(bad)
        assert e.value.status == 400 and e.value.param == "prompt"
    req = decode_request(
        b'{"prompt": "x", "temperature": 0, "seed": 7, "stop": "\\n", "top_k": 5, "n": 2}', CompletionRequest
    )
    sp = sampling_params(req, max_tokens=8, logprobs=None, choice=1)
    assert (sp.temperature, sp.seed, sp.stop, sp.top_k, sp.max_tokens) == (0.0, 8, ["\n"], 5, 8)
    with pytest.raises(APIError) as e:
        sampling_params(decode_request(b'{"top_p": 0}', CompletionRequest), max_tokens=1, logprobs=None)
    assert e.value.param == "top_p"
    with pytest.raises(APIError) as e:
        decode_request(b'{"max_tokens": "8"}', CompletionRequest)
    assert e.value.param == "max_tokens"
    with pytest.raises(APIError) as e:
        decode_request(b"{oops", CompletionRequest)
    assert e.value.code == "invalid_json"
    for body, param, says in (
        (b'{"messages": [], "tools": [{"type": "function"}], "tool_choice": "required"}', "tools", "tools[0] must be"),
        (b'{"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]}', "tool_choice", "'auto'"),
        (b'{"messages": [], "tool_choice": "required"}', "tool_choice", "needs tools"),
        (b'{"messages": [], "response_format": {"type": "json_schema"}}', "response_format", "json_schema.schema"),
        (b'{"messages": [], "response_format": {"type": "yaml"}}', "response_format", "'yaml' is not one of"),
        (b'{"messages": [], "guided_regex": "a", "guided_choice": ["b"]}', "guided_choice", "give one constraint"),
        (b'{"messages": [], "structured_outputs": {"regex": "a", "json": {}}}', "structured_outputs", "exactly one"),
    ):
        req = decode_request(body, ChatCompletionRequest)
        with pytest.raises(APIError) as e:
            tool_plan(req, "") or constraint_of(req)
        assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message
    req = decode_request(b'{"messages": [], "guided_json": {"type": "object"}}', ChatCompletionRequest)
    assert constraint_of(req) == StructuredOutput(json={"type": "object"})
    assert parse_host_port("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_host_port(":9") == ("127.0.0.1", 9) and parse_host_port("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError):
        parse_host_port("localhost:http")


# -- one server process for the module ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    return shared_server(request.config, tmp_path_factory.mktemp("http"))


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["key"], timeout=120, max_retries=0)
    yield c
    c.close()


def _engine(server):
    from workbench import EngineClient

    return EngineClient.connect(server["name"])


@pytest.mark.timeout(300)
def test_openai_client_non_streaming(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server["model_name"]] and models.data[0].owned_by == "workbench"
    r = client.completions.create(
        model=server["model_name"],
        prompt=["Hello there", "Good night"],
        max_tokens=5,
        temperature=0,
        n=2,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy choices of one prompt agree
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and len(lp.top_logprobs[0]) == 2
    if "\ufffd" not in "".join(lp.tokens):  # a lone byte of a UTF-8 character decodes as U+FFFD alone
        assert "".join(lp.tokens) == r.choices[0].text
    # seeded sampling is reproducible, choices of one request differ by seed
    a = client.completions.create(model=server["model_name"], prompt="Once", max_tokens=6, temperature=1.0, seed=3, n=2)
    b = client.completions.create(model=server["model_name"], prompt="Once", max_tokens=6, temperature=1.0, seed=3)
    assert a.choices[0].text == b.choices[0].text
    # token-id prompts and echo
    e = client.completions.create(
        model=server["model_name"], prompt=[19556, 665], max_tokens=2, echo=True, temperature=0
    )
    assert e.choices[0].text.startswith("Hello there")
    chat = client.chat.completions.create(
        model=server["model_name"],
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == 4 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    assert chat.usage.prompt_tokens > 10 and chat.usage.completion_tokens == 4
    # stop strings: cut where the third token's text first appears
    g = client.completions.create(model=server["model_name"], prompt="a b c", max_tokens=6, temperature=0, logprobs=0)
    word = g.choices[0].logprobs.tokens[2]
    if word.strip() and "\ufffd" not in word:
        st = client.completions.create(
            model=server["model_name"], prompt="a b c", max_tokens=6, temperature=0, stop=[word]
        )
        assert st.choices[0].finish_reason == "stop"
        assert st.choices[0].text == g.choices[0].text[: g.choices[0].text.find(word)]


@pytest.mark.timeout(300)
def test_openai_client_penalties_bias_min_tokens_and_echoed_prompt_logprobs(server, client):
    name = server["model_name"]
    # echo + logprobs: the prompt's tokens first (the first without a log-probability), then the answer's
    e = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  echo=True, logprobs=1)  # fmt: skip
    lp, n = e.choices[0].logprobs, e.usage.prompt_tokens
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == e.choices[0].text and e.choices[0].text.startswith("The capital of France is")
    plain = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3, temperature=0,
                                      logprobs=1)  # fmt: skip
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    # logit_bias: +100 on one token makes it every greedy choice; min_tokens holds off EOS (id 2 here)
    b = client.completions.create(model=name, prompt="Hi", max_tokens=4, temperature=0, logit_bias={"28": 100},
                                  extra_body={"return_token_ids": True})  # fmt: skip
    assert b.choices[0].model_extra["token_ids"] == [28] * 4
    m = client.completions.create(model=name, prompt="Hi", max_tokens=5, temperature=0, logit_bias={"2": 100},
                                  extra_body={"min_tokens": 3, "return_token_ids": True})  # fmt: skip
    assert m.choices[0].model_extra["token_ids"][3:] == [2] and 2 not in m.choices[0].model_extra["token_ids"][:3]
    assert m.choices[0].finish_reason == "stop"
    # presence and frequency penalties end repetition: the biased token once, then others
    p = client.completions.create(model=name, prompt="Hi", max_tokens=4, temperature=0, logit_bias={"28": 3},
                                  presence_penalty=2.0, frequency_penalty=2.0,
                                  extra_body={"return_token_ids": True})  # fmt: skip
    assert p.choices[0].model_extra["token_ids"].count(28) < 4


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {"type": "object", "properties": {"nights": {"enum": [1, 2, 3]}}, "required": ["nights"]},
    },
}


@pytest.mark.timeout(300)
def test_openai_client_structured_output_and_tools(server, client):
    """response_format (json_schema, json_object), vLLM's fields, and tools with a required or named
    tool_choice, through the official client, streamed and not; a bad schema is a 400 naming it and
    the engine serves the next request."""
    import jsonschema

    name = server["model_name"]
    schema = WEATHER["function"]["parameters"]
    msgs = [{"role": "user", "content": "Weather?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=40, seed=1, response_format=fmt, n=3)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), schema)
    streamed = client.chat.completions.create(
        model=name, messages=msgs, max_tokens=40, temperature=0, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = client.completions.create(model=name, prompt="{", max_tokens=30, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=name, prompt="x", max_tokens=30, temperature=0.8, seed=2,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})  # fmt: skip
    assert re.fullmatch("[0-9]{3}", r.choices[0].text)
    # greedy (an unseeded draw could close the object within 3 tokens)
    r = client.chat.completions.create(
        model=name, messages=msgs, max_tokens=3, temperature=0, response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "length", r.choices[0].message.content  # cut before it closed: said

    for stream in (False, True):
        kw = dict(model=name, messages=msgs, max_tokens=80, temperature=0, tools=[WEATHER, BOOK])
        named = {"type": "function", "function": {"name": "get_weather"}}
        if stream:
            chunks = list(client.chat.completions.create(**kw, tool_choice=named, stream=True))
            [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            calls, finish = delta.tool_calls, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.chat.completions.create(**kw, tool_choice=named).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    choice = client.chat.completions.create(**kw, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "book": BOOK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # the conversation goes on with the call and its answer in it
    follow = msgs + [choice.message.model_dump(exclude_none=True)]
    follow += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in choice.message.tool_calls]
    r = client.chat.completions.create(model=name, messages=follow, max_tokens=4, tool_choice="none", tools=[WEATHER])
    assert r.choices[0].message.tool_calls is None

    with pytest.raises(openai.BadRequestError) as e:  # tool_choice auto: this model's template has no tools
        client.chat.completions.create(model=name, messages=msgs, max_tokens=4, tools=[WEATHER])
    assert e.value.param == "tool_choice" and "chat template" in e.value.message
    bad = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "bogus"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=msgs, max_tokens=4, response_format=bad)
    assert "structured.json is invalid: Unsupported type" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=4, extra_body={"guided_regex": "(("})
    assert "structured.regex is invalid" in e.value.message
    assert client.completions.create(model=name, prompt="x", max_tokens=2).choices[0].finish_reason


# A chat template that defines tool calls as Hermes and Qwen do: <tool_call>{"name", "arguments"}</tool_call>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions: <tools>{% for t in tools %}"
    "{{ t | tojson }}{% endfor %}</tools>\nCall one as <tool_call>\n"
    '{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_in_the_templates_own_form(tmp_path):
    """Where the chat template defines tool calls (<tool_call> blocks), the template describes the
    tools, "auto" lets the model decide, "required" and a named function must call, and every call is
    held to its tool's schema; the blocks come back as tool_calls, the text around them as content."""
    import jsonschema

    from workbench.http.structured import tool_plan

    req = decode_request(
        json.dumps({"messages": [], "tools": [WEATHER, BOOK], "tool_choice": "auto"}).encode(), ChatCompletionRequest
    )
    plan = tool_plan(req, TOOL_TEMPLATE)
    text = 'Let me look. <tool_call>\n{"name": "book", "arguments": {"nights": 2}}\n</tool_call>'
    content, calls = plan.answer(text)
    assert content == "Let me look." and [c["function"]["arguments"] for c in calls] == ['{"nights": 2}']
    assert plan.answer("No call here.") == ("No call here.", None)

    proc, url, name, log = _own_front(tmp_path, chat_template=TOOL_TEMPLATE)
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    try:
        model = c.models.list().data[0].id
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        kw = dict(model=model, messages=msgs, max_tokens=60, temperature=0, tools=[WEATHER, BOOK])
        r = c.chat.completions.create(**kw, tool_choice="auto", extra_body={"return_token_ids": True})
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for choice in (
            c.chat.completions.create(**kw, tool_choice="required").choices[0],
            c.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "book"}}).choices[0],
        ):
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            for call in choice.message.tool_calls:
                tool = {"get_weather": WEATHER, "book": BOOK}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert [t.function.name for t in choice.message.tool_calls] == ["book"]
        from workbench.tokenizer import Tokenizer

        shown = Tokenizer.from_dir(tmp_path / "m").decode(r.model_extra["prompt_token_ids"])
        assert "You may call these functions" in shown and '"name": "get_weather"' in shown  # the template's words
    finally:
        c.close()
        stop_process(proc)


@pytest.mark.timeout(300)
def test_openai_client_streaming(server, client):
    chunks = list(
        client.chat.completions.create(
            model=server["model_name"],
            messages=[{"role": "user", "content": "Tell me"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            n=2,
        )
    )
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(c.choices[0].index for c in roles) == [0, 1]
    text = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"} and text[0] == text[1] != ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    full = client.chat.completions.create(
        model=server["model_name"], messages=[{"role": "user", "content": "Tell me"}], max_tokens=5, temperature=0
    )
    assert full.choices[0].message.content == text[0]
    comp = list(
        client.completions.create(
            model=server["model_name"], prompt="The sky", max_tokens=4, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].text for c in comp if c.choices)
        == client.completions.create(model=server["model_name"], prompt="The sky", max_tokens=4, temperature=0)
        .choices[0]
        .text
    )


@pytest.mark.timeout(300)
def test_errors_are_openai_objects(server, client):
    url, name = server["url"], server["model_name"]
    bad_key = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    bad_key.close()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=2, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "word " * (MAX_LEN + 50)}], max_tokens=4
        )
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
        client.completions.create(model=name, prompt="word " * (MAX_LEN - 100), max_tokens=200)
    with pytest.raises(openai.BadRequestError):  # token ids outside the vocabulary: rejected by the engine
        client.completions.create(model=name, prompt=[10**7], max_tokens=1)
    h = {"Authorization": f"Bearer {server['key']}", "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", content=b"x" * (2 << 20), headers=h)  # the server allows 1 MiB
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/nope", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "logit_bias": {"x1": 5}}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert "token ids" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "logit_bias": {"1": 500}}, headers=h)
    assert r.status_code == 400 and "[-100, 100]" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "presence_penalty": 3}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"
    r = httpx.post(
        url + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, headers=h
    )
    assert r.status_code == 400 and "stream=false" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200  # no key needed
    assert httpx.get(url + "/v1/models").status_code == 401


def _finished(engine, since: int) -> list:
    return [ev for ev in engine.timeline(since).requests if ev.kind == "finished"]


@pytest.mark.timeout(300)
def test_client_disconnect_aborts_in_engine(server):
    engine = _engine(server)
    try:
        h = {"Authorization": f"Bearer {server['key']}"}
        body = {"prompt": "Go on", "max_tokens": MAX_LEN - 16, "ignore_eos": True, "temperature": 0}
        # streaming: read one event, then hang up
        since = engine.timeline(1 << 62).cursor
        with httpx.stream(
            "POST", server["url"] + "/v1/completions", json={**body, "stream": True}, headers=h, timeout=60
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break
        deadline = time.monotonic() + 30
        while not _finished(engine, since) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [ev.detail for ev in _finished(engine, since)] == ["abort"]
        # non-streaming: the client gives up (read timeout) while the engine works
        since = engine.timeline(1 << 62).cursor
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server["url"] + "/v1/completions", json=body, headers=h, timeout=httpx.Timeout(30, read=0.5))
        deadline = time.monotonic() + 30
        while not _finished(engine, since) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [ev.detail for ev in _finished(engine, since)] == ["abort"]
        assert engine.metrics()["num_running"] == 0
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_prometheus_metrics(server, client):
    from workbench.remote import parse_prometheus, server_metrics

    client.completions.create(model=server["model_name"], prompt="Count", max_tokens=3, temperature=0)
    assert httpx.get(server["url"] + "/metrics").status_code == 401  # the host's CPU and memory: behind the key
    text = httpx.get(server["url"] + "/metrics", headers={"Authorization": f"Bearer {server['key']}"}).text
    samples = parse_prometheus(text)
    model = server["model_name"]
    for name in (
        "workbench:num_requests_running",
        "workbench:num_requests_waiting",
        "workbench:kv_cache_usage_perc",
        "workbench:prefix_cache_hit_rate",
        "workbench:spec_decode_draft_acceptance_rate",
        "workbench:generation_tokens_total",
        "workbench:prompt_tokens_total",
        "workbench:time_to_first_token_seconds_bucket",
        "workbench:inter_token_latency_seconds_count",
        "workbench:e2e_request_latency_seconds_sum",
        "workbench:request_success_total",
        "workbench:cache_config_info",
    ):
        assert name in samples, name
        assert all(labels.get("model_name") == model for labels, _ in samples[name])
    assert samples["workbench:time_to_first_token_seconds_count"][0][1] >= 1
    m = server_metrics(samples)
    assert m["num_running"] == 0 and 0 <= m["kv_usage"] <= 1 and m["total_output_tokens"] >= 3
    assert m["server_ttft_p50_ms"] > 0


LOAD_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, time
    import httpx

    url, key, model, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    async def one(client, i):
        prompt = f"Request number {i} says hello"
        want = 1 + i % 6
        body = {"model": model, "prompt": prompt, "max_tokens": want, "temperature": 0, "ignore_eos": True,
                "echo": True, "stream": True, "stream_options": {"include_usage": True}}
        text, finish, usage, done, ids = "", None, None, False, set()
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, (resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                ids.add(obj["id"])
                for c in obj["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                usage = obj.get("usage") or usage
        return {"i": i, "ok": done and text.startswith(prompt) and finish == "length" and len(ids) == 1
                and usage["completion_tokens"] == want, "text": text[:80], "finish": finish, "usage": usage}

    async def main():
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=180, limits=limits) as client:
            t = time.monotonic()
            results = await asyncio.gather(*(one(client, i) for i in range(n)))
            print(json.dumps({"seconds": time.monotonic() - t, "results": results}))

    asyncio.run(main())
""")


@pytest.mark.timeout(400)
def test_64_concurrent_streams_from_another_process(server):
    """64 streams at once from a separate process: every answer is complete, echoes its own prompt,
    has its own length (1..6 tokens) and one response id -- nothing lost or crossed."""
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, server["url"], server["key"], server["model_name"], "64"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    bad = [r for r in report["results"] if not r["ok"]]
    assert not bad, bad[:3]
    assert len(report["results"]) == 64
    engine = _engine(server)
    try:
        assert engine.metrics()["num_running"] == 0
    finally:
        engine.close()


# -- hardening: bad numbers, big prompts, SIGTERM ---------------------------------------------------
@pytest.mark.timeout(300)
def test_bad_numbers_and_bounds_are_400s_naming_the_field(server):
    url, h = server["url"], {"Authorization": f"Bearer {server['key']}"}
    cases = [
        ('"seed": 18446744073709551616', "seed", "seed must be in"),  # 2**64: was a 500
        ('"temperature": 1e400', "temperature", "out of range"),
        ('"stop": [' + ",".join(f'"s{i}"' for i in range(17)) + "]", "stop", "at most 16"),
        ('"stop": ["' + "x" * 5000 + '"]', "stop", "at most 4096"),
    ]
    for extra, param, words in cases:
        r = httpx.post(
            url + "/v1/completions",
            headers={**h, "content-type": "application/json"},
            content=('{"prompt": "hi", "max_tokens": 2, ' + extra + "}").encode(),
        )
        assert r.status_code == 400, (extra[:40], r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, (extra[:40], err)
    r = httpx.post(
        url + "/v1/completions",
        headers={**h, "content-type": "application/json"},
        content=b'{"prompt": "hi", "temperature": NaN}',
    )  # not JSON at all
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    ok = httpx.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1, "stop": ["zz"] * 16},
        headers=h,
        timeout=60,
    )
    assert ok.status_code == 200, ok.text  # the edges of the ranges are allowed
    # n seeded choices take seed, seed + 1, ...: past 2**64 - 1 that wraps around, as a uint64 does
    # (it was refused, quoting 2**64, a value the client never sent)
    two = httpx.post(
        url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 4, "seed": 2**64 - 1, "n": 2, "temperature": 1.0},
        headers=h,
        timeout=60,
    )
    assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text


@pytest.mark.timeout(300)
def test_oversized_prompts_are_refused_while_a_stream_runs(server):
    url, h = server["url"], {"Authorization": f"Bearer {server['key']}"}
    body = {"prompt": "Once", "max_tokens": 800, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, headers=h, timeout=120)
    lines: list[str] = []

    def stream():
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            headers=h,
            timeout=120,
            json={**body, "stream": True, "return_token_ids": True},
        ) as r:
            lines.extend(x for x in r.iter_lines() if x)

    t = threading.Thread(target=stream)
    t.start()
    big = "word " * 190_000  # 950 kB, under the 1 MiB body limit; 81 x 2048 characters is the length bound
    for _ in range(10):
        r = httpx.post(url + "/v1/completions", json={"prompt": big, "max_tokens": 1}, headers=h, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "at least" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    t.join(120)
    assert lines[-1] == "data: [DONE]"
    tokens = [tok for x in lines[:-1] for c in json.loads(x[6:])["choices"] for tok in c.get("token_ids", [])]
    assert tokens == alone.json()["choices"][0]["token_ids"]


def _own_front(tmp_path, *flags: str, max_len: int | None = None, chat_template: str | None = None):
    from http_helpers import MAX_LEN, free_port, make_tiny_tokenized_model, wait_http

    model = make_tiny_tokenized_model(tmp_path / "m", max_len=max_len or MAX_LEN)
    if chat_template is not None:
        cfg_file = model / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        cfg_file.write_text(json.dumps({**cfg, "chat_template": chat_template}))
    port = free_port()
    name = f"drain-{port}"
    log = tmp_path / "front.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workbench.cli",
                "serve",
                "--http",
                f"127.0.0.1:{port}",
                "--model",
                str(model),
                "--name",
                name,
                "--http-log-level",
                "warning",
                *flags,
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc, 240, log)
    return proc, url, name, log


def _sse_lines(url: str, body: dict, into: list, status: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        status.append(r.status_code)
        if r.status_code == 200:
            into.extend(x for x in r.iter_lines() if x)
        else:
            r.read()
            into.append(r.json())


@pytest.mark.timeout(300)
def test_sigterm_drains_streams_then_ends_them_cleanly(tmp_path):
    """The first SIGTERM: running streams go on; at the drain deadline each ends with an error
    event and [DONE] (a complete body, no cut connection); queued requests get a 503."""
    from workbench.ipc import connection as conn

    # 16,000 tokens each, one at a time: the tiny model decodes ~1,000 tokens/s, and 2,000 could
    # finish before the deadline (it did once in a full run)
    proc, url, name, log = _own_front(tmp_path, "--drain-timeout", "1.5", "--max-num-seqs", "1", max_len=16384)
    try:
        body = {"prompt": "Once", "max_tokens": 16000, "temperature": 0, "ignore_eos": True}
        got = [([], []) for _ in range(4)]
        threads = [threading.Thread(target=_sse_lines, args=(url, body, lines, st)) for lines, st in got]
        for t in threads:
            t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down", late.text
        assert late.headers["retry-after"] == "5"
        health = httpx.get(url + "/health", timeout=30)  # still listening, and says why it refuses
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for t in threads:
            t.join(60)  # no exception in the reader: every body was complete
        ends = []
        for lines, status in got:
            if status == [200]:
                assert lines[-1] == "data: [DONE]", lines[-3:]
                last = json.loads(lines[-2][6:])
                ends.append("cut" if "error" in last else last["choices"][0]["finish_reason"])
                if "error" in last:
                    assert last["error"]["code"] == "server_shutting_down", last
                    assert "drain deadline (1.5 s)" in last["error"]["message"]
            else:  # never started: answered with an error, not a dropped connection
                assert status == [503] and lines[0]["error"]["code"] == "server_shutting_down", lines
                ends.append("503")
        assert "cut" in ends and "503" in ends, ends  # one was streaming at the deadline, others waited
        assert proc.wait(30) == 0
        assert not conn.connection_path(name).exists()  # the front stopped its engine
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(300)
def test_second_sigterm_stops_the_front_at_once(tmp_path):
    from workbench.ipc import connection as conn

    # 16,000 tokens: the tiny model decodes 1,000-2,000 tokens/s, and a request of 2,000 that got
    # the one slot first finished before the second signal (a 200 where a 503 was due)
    proc, url, name, log = _own_front(tmp_path, "--drain-timeout", "120", "--max-num-seqs", "1", max_len=16384)
    try:
        lines, st, plain = [], [], []
        body = {"prompt": "Once", "max_tokens": 16000, "ignore_eos": True}
        t = threading.Thread(target=lambda: _ignore_errors(_sse_lines, url, body, lines, st))
        waiting = threading.Thread(
            target=lambda: plain.append(httpx.post(url + "/v1/completions", json=body, timeout=60))
        )
        t.start()
        deadline = time.monotonic() + 60
        while not lines and time.monotonic() < deadline:  # the stream holds the one slot before the other asks
            time.sleep(0.01)
        waiting.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining, for up to 120 s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        t.join(30)
        waiting.join(30)
        # ended with an answer that says why, not a 499 with an empty body
        assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
        assert "second signal" in plain[0].json()["error"]["message"]
        # the running stream: an error event, then [DONE]
        assert st == [200] and lines[-1] == "data: [DONE]" and "second signal" in lines[-2], lines[-2:]
        assert not conn.connection_path(name).exists()  # no stale connection file
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(300)
def test_attached_front_answers_503_while_its_engine_drains(tmp_path):
    """An engine told to stop (SIGTERM) finishes what it runs and refuses new work; the HTTP front
    attached to it answers 503 server_shutting_down with Retry-After and /health says draining."""
    from http_helpers import free_port, make_tiny_tokenized_model, wait_http

    model = make_tiny_tokenized_model(tmp_path / "m")
    name = f"drained-{free_port()}"
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--model",
            str(model),
            "--name",
            name,
            "--drain-timeout",
            "20",
            "--max-num-seqs",
            "1",
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    front = None
    try:
        from workbench.ipc import connection as conn

        deadline = time.monotonic() + 240
        while not conn.connection_path(name).exists():  # written once the engine is ready
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        front = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workbench.http",
                "--attach",
                name,
                "--http",
                f"127.0.0.1:{port}",
                "--model",
                str(model),
                "--http-log-level",
                "warning",
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        wait_http(url, front, 240)
        lines, st = [], []
        t = threading.Thread(
            target=_sse_lines, args=(url, {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True}, lines, st)
        )
        t.start()
        time.sleep(1.0)
        engine.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while True:  # the engine's next heartbeat (or refusal) tells the front
            r = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2}, timeout=30)
            if r.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down" and r.headers["retry-after"] == "5"
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        t.join(60)
        assert st == [200] and lines[-1] == "data: [DONE]"  # the stream that ran finished whole
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        for proc in (front, engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except httpx.HTTPError:
        pass  # the second signal cuts the stream: that is what it is for


# -- hostile input (issue 32.3, 32.5, 32.7) ---------------------------------------------------------
def _keepalive_posts(url: str, key: str, bodies: list[bytes]) -> list[tuple[int, dict]]:
    """POST each body on one keep-alive connection; fails if the server closed it in between."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    out, sock = [], None
    try:
        for body in bodies:
            connection.request(
                "POST",
                "/v1/completions",
                body=body,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            response = connection.getresponse()
            data = response.read()
            assert sock is None or connection.sock is sock, "the server dropped the keep-alive connection"
            sock = connection.sock
            assert response.getheader("connection", "").lower() != "close"
            out.append((response.status, json.loads(data)))
    finally:
        connection.close()
    return out


def test_hostile_json_gets_400s_naming_the_field_and_keeps_the_connection(server):
    deep = "[" * 10_000 + "]" * 10_000
    cases = [
        (b'{"prompt": [' + str(2**64).encode() + b'], "max_tokens": 1}', "prompt", "outside the vocabulary"),
        (b'{"prompt": [-1], "max_tokens": 1}', "prompt", "outside the vocabulary"),
        (b'{"prompt": "x", "stop_token_ids": [' + str(2**64).encode() + b"]}", "stop_token_ids", "2**63"),
        (('{"prompt": ' + deep + "}").encode(), "prompt", "nests"),
        (('{"prompt": "x", "response_format": {"type": ' + deep + "}}").encode(), "response_format", "nests"),
        (('{"prompt": "x", "tool_choice": ' + deep + "}").encode(), "tool_choice", "nests"),
        (b'{"prompt": [' + b"5," * (MAX_LEN + 10) + b"5]}", "prompt", "maximum context length"),
        # invalid UTF-8 inside the prompt string, twice on one connection (it reset the connection)
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "prompt", "not valid JSON text"),
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "prompt", "not valid JSON text"),
        (b'{"prompt": "hi", "max_tokens": 1}', None, None),  # and the connection still serves
    ]
    log_before = server["log"].read_text(errors="replace")
    answers = _keepalive_posts(server["url"], server["key"], [body for body, _, _ in cases])
    for (body, param, words), (status, answer) in zip(cases, answers):
        if param is None:
            assert status == 200, answer
            continue
        assert status == 400, (body[:60], answer)
        assert answer["error"]["param"] == param and words in answer["error"]["message"], (body[:60], answer)
    logged = server["log"].read_text(errors="replace")[len(log_before) :]
    assert "Exception in ASGI application" not in logged and "Traceback" not in logged, logged[-2000:]
    r = httpx.post(
        server["url"] + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {server['key']}"},
        content=('{"messages": [{"role": "user", "content": ' + deep + "}]}").encode(),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_token_id_prompts_are_bounded_before_they_are_scanned():
    """A prompt of 8 million ids (a 16 MiB body) is refused from its length alone; the per-id
    checks are C-speed passes over what can fit."""
    ids = [5] * 8_000_000
    with pytest.raises(APIError) as e:
        completion_prompts(ids, 2048, 49152)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "8000000 token ids" in e.value.message
    assert completion_prompts([[1, 2], [3]], 2048, 49152) == [[1, 2], [3]]
    for bad in ([1, 2, 49152], [[1], [2**70]], [1, -3]):
        with pytest.raises(APIError) as e:
            completion_prompts(bad, 2048, 49152)
        assert "outside the vocabulary [0, 49152)" in e.value.message
    with pytest.raises(APIError):
        completion_prompts([1, True], 2048, 49152)  # a bool is no token id


def test_fuzzed_requests_never_get_a_500(server):
    """A few thousand generated bodies, valid and not, against both routes: every answer is a
    status the API documents with an OpenAI error object, never a 500, and the server still serves."""
    import random

    rng = random.Random(7)
    values = [
        None,
        True,
        False,
        0,
        1,
        -1,
        7,
        2**31,
        2**63,
        2**64,
        -(2**64),
        1e308,
        -0.0,
        0.5,
        "",
        "x",
        "é😀",
        "word " * 50,
        [],
        [1],
        [[1, 2]],
        [1, "a"],
        [[]],
        {},
        {"type": "text"},
        {"a": [1]},
        [None],
        "[" * 64 + "]" * 64,
    ]
    fields = [
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stop",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "logprobs",
        "echo",
        "return_token_ids",
        "stream_options",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tool_choice",
        "tools",
        "presence_penalty",
        "logit_bias",
        "min_tokens",
        "best_of",
        "suffix",
        "user",
    ]

    def value():
        return rng.choice(values)

    def body(chat: bool) -> bytes:
        if rng.random() < 0.05:  # not JSON, or not an object
            return rng.choice([b"", b"[]", b"null", b"{", b'{"prompt": "x",}', b"\xff\xfe", b'"x"', b"1e999"])
        obj = {"max_tokens": rng.choice([1, 2, 3, 0, -5, 10**9, "2"])}
        if chat:
            obj["messages"] = rng.choice(
                [
                    [{"role": "user", "content": value()}],
                    [{"role": value(), "content": "x"}],
                    value(),
                    [{"content": "x"}],
                    [{"role": "user", "content": [value()]}],
                ]
            )
        else:
            obj["prompt"] = rng.choice([value(), "hello", [5, 6], [[5], [6, 7]], [rng.randint(-5, 10**6)]])
        for name in rng.sample(fields, rng.randint(0, 5)):
            obj[name] = value()
        if obj.get("stream") is True and rng.random() < 0.7:
            obj["stream"] = False  # streams are slower to read to the end: fewer of them
        if isinstance(obj.get("n"), int) and not isinstance(obj.get("n"), bool) and obj["n"] > 4:
            obj["n"] = 4
        return json.dumps(obj).encode()

    url, h = server["url"], {"Authorization": f"Bearer {server['key']}", "Content-Type": "application/json"}
    seen: dict[int, int] = {}
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=60, headers=h) as c:
        for i in range(2500):
            if time.monotonic() > deadline:
                break
            chat = i % 2 == 1
            data = body(chat)
            r = c.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=data)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), (data[:200], r.text[-300:])
            else:
                assert r.status_code in (200, 400, 404, 413), (data[:200], r.status_code, r.text[:300])
                if r.status_code != 200:
                    err = r.json()["error"]
                    assert err["message"] and err["type"] == "invalid_request_error", (data[:200], err)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
    assert sum(seen.values()) >= 1000 and seen.get(200, 0) > 50 and seen.get(400, 0) > 200, seen
    assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_api_description_needs_the_key_and_the_key_stays_out_of_ps(server):
    url, h = server["url"], {"Authorization": f"Bearer {server['key']}"}
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(url + path, timeout=30).status_code == 401
        assert httpx.get(url + path, headers=h, timeout=30).status_code == 200
    assert "/v1/completions" in httpx.get(url + "/openapi.json", headers=h, timeout=30).json()["paths"]
    cmdline = Path(f"/proc/{server['proc'].pid}/cmdline").read_bytes()
    assert server["key"].encode() not in cmdline and b"--api-key-file" in cmdline


def test_a_body_that_never_arrives_gets_a_408(server):
    """The shared server waits 5 s for a body (--request-read-timeout 5), then answers 408 and
    frees the connection (it held 1,000 such connections for a minute and more)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(server["url"])
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + server["key"].encode() + b'\r\nContent-Length: 100\r\n\r\n{"pro'
        )
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_the_front_bounds_the_text_it_tokenizes():
    """Issue 32.6: the HTTP front tokenized every text prompt on its own pool, without the engine's
    --max-queued-chars bound (40 concurrent 650,000-digit prompts: all encoded, the slowest after
    34 s, no 503). It now refuses what would exceed the bound, as the engine does."""
    import asyncio

    from workbench.http.server import load_front_tokenizer
    from workbench.http.serving import Serving

    front = Serving(
        None,
        model_names=["m"],
        tokenizer=load_front_tokenizer("smollm2-135m"),
        max_model_len=8192,
        max_queued_chars=2_000_000,
    )
    text = "7" * 650_000

    async def attack():
        return await asyncio.gather(
            *(front.encode(text, add_special_tokens=True, param="prompt") for _ in range(40)), return_exceptions=True
        )

    results = asyncio.run(attack())
    busy = [r for r in results if isinstance(r, APIError) and r.status == 503]
    too_long = [r for r in results if isinstance(r, APIError) and r.status == 400]
    assert len(busy) + len(too_long) == 40 and len(too_long) <= 3 and busy, [type(r) for r in results]
    assert busy[0].code == "engine_overloaded" and busy[0].headers == {"retry-after": "1"}
    assert "limit 2,000,000" in busy[0].message
    assert all("its first 16,383 alone" in r.message for r in too_long)  # refused from a prefix
    assert front.tokenizing_chars == 0
    ok = asyncio.run(front.encode("hello there", add_special_tokens=True, param="prompt"))
    assert ok == front.tokenizer.encode("hello there", add_special_tokens=True)


def test_metrics_follow_the_key_unless_opened_for_scrapers(tiny_llama):
    """/metrics shows the host's CPU and memory: with a key it needs the key, unless the server was
    started with --metrics-without-key; /health stays open either way."""
    from starlette.testclient import TestClient

    from workbench import LLM
    from workbench.http.app import create_app
    from workbench.http.server import make_serving

    engine = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=16)
    for open_metrics, status in ((False, 401), (True, 200)):
        front = make_serving(engine, api_key="k3y", tokenizer=None, open_metrics=open_metrics)
        with TestClient(create_app(front)) as http:
            assert http.get("/metrics").status_code == status
            assert http.get("/metrics", headers={"Authorization": "Bearer k3y"}).status_code == 200
            assert http.get("/health").status_code == 200


def test_each_route_handler_answers_alone(tiny_llama):
    """Issue 48.4: the routes are module-level handlers over the app's `Serving`, callable without
    FastAPI's routing: a hand-built request gets the engine's own greedy tokens, bad input raises
    the 400 the app would send, and the drain's count of running handlers goes back to zero."""
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    from workbench import LLM, SamplingParams
    from workbench.http.routes import admin, chat, completions, models
    from workbench.http.server import make_serving

    engine = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=16)
    serving = make_serving(engine, served_model_name="tiny", tokenizer=None)
    app = SimpleNamespace(state=SimpleNamespace(serving=serving))

    def request(path: str, body: bytes = b"") -> Request:
        sent = False

        async def receive():
            nonlocal sent
            if sent:  # the client stays connected
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(b"content-length", str(len(body)).encode())]
        scope = {"type": "http", "method": "POST" if body else "GET", "path": path, "headers": headers,
                 "query_string": b"", "app": app}  # fmt: skip
        return Request(scope, receive)

    body = b'{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "return_token_ids": true}'
    answer = asyncio.run(completions.completions(request("/v1/completions", body)))
    choice = json.loads(answer.body)["choices"][0]
    [want] = engine.generate(prompt_token_ids=[[5, 6, 7]], params=SamplingParams(temperature=0, max_tokens=4))
    assert choice["token_ids"] == want.token_ids and len(want.token_ids) == 4
    assert serving.inflight == 0
    with pytest.raises(APIError) as e:
        asyncio.run(completions.completions(request("/v1/completions", b'{"prompt": [5], "max_tokens": -1}')))
    assert (e.value.status, e.value.param) == (400, "max_tokens") and serving.inflight == 0
    # no tokenizer anywhere: text and chats are refused, saying how to send the prompt instead
    with pytest.raises(APIError) as e:
        asyncio.run(completions.completions(request("/v1/completions", b'{"prompt": "Hello", "max_tokens": 2}')))
    assert e.value.status == 400 and "text cannot be encoded: give the prompt as token ids" in e.value.message
    chat_body = b'{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}'
    with pytest.raises(APIError) as e:
        asyncio.run(chat.chat_completions(request("/v1/chat/completions", chat_body)))
    assert e.value.status == 400 and "a chat cannot be rendered: give the prompt as token ids" in e.value.message
    assert serving.inflight == 0
    with pytest.raises(APIError) as e:
        asyncio.run(models.get_model(request("/v1/models/nope"), "nope"))
    assert e.value.status == 404 and "'tiny'" in e.value.message
    listed = asyncio.run(models.list_models(request("/v1/models")))
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    health = asyncio.run(admin.health(request("/health")))
    assert health.status_code == 200 and json.loads(health.body)["model"] == "tiny"


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch, tiny_llama):
    """Decoding megabytes of JSON holds the GIL for tens of ms: a large body is decoded on a worker
    thread (the loop still gets the GIL every switch interval, so other streams keep flowing)."""
    import asyncio
    import threading

    from workbench import LLM
    from workbench.http import serving as serving_module
    from workbench.http.protocol import CompletionRequest
    from workbench.http.server import make_serving

    front = make_serving(LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=16), tokenizer=None)
    threads = []
    real = serving_module.decode_request
    monkeypatch.setattr(
        serving_module, "decode_request", lambda b, k: threads.append(threading.get_ident()) or real(b, k)
    )

    async def both():
        loop_thread = threading.get_ident()
        small = b'{"prompt": [5, 6], "max_tokens": 1}'
        large = b'{"prompt": [' + b"5," * (serving_module.OFF_LOOP_BYTES // 2) + b'5], "max_tokens": 1}'
        await front.decode(small, CompletionRequest)
        await front.decode(large, CompletionRequest)
        return loop_thread

    loop_thread = asyncio.run(both())
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_a_client_that_dribbles_its_headers_is_cut_off(tiny_llama):
    """Slow-header clients (a header line now and then, never the blank line) were held open with
    no timeout: the connection closes once its headers have taken longer than the header timeout,
    and a normal request on a fresh connection is served."""
    import socket

    from workbench import LLM
    from workbench.http.server import start_http_server

    handle = start_http_server(LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=16), header_timeout=1.0)
    try:
        with socket.create_connection((handle.host, handle.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            closed_after = None
            for i in range(40):  # up to 8 s of dribbling, a line every 0.2 s
                time.sleep(0.2)
                try:
                    sock.sendall(f"X-Slow-{i}: y\r\n".encode())
                except OSError:
                    closed_after = i
                    break
                sock.settimeout(0.01)
                try:
                    if sock.recv(1) == b"":
                        closed_after = i
                        break
                except TimeoutError:
                    pass
            assert closed_after is not None and closed_after < 25, closed_after  # ~1 s, well before 8
        r = httpx.get(f"http://{handle.host}:{handle.port}/health", timeout=10)
        assert r.status_code == 200
    finally:
        handle.stop()
