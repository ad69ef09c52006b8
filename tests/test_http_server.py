"""The OpenAI-compatible endpoint (`workbench serve --http`), from a separate server process:
the official `openai` client, error objects, SSE, disconnect -> abort, Prometheus /metrics, and a
64-stream load from yet another process. Pure mapping code is tested without a server first."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
from http_helpers import MAX_LEN, ROOT, shared_server

from workbench.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    completion_prompts,
    decode_request,
    sampling_params,
)
from workbench.http.server import parse_host_port

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
    req = decode_request(b'{"prompt": "x", "temperature": 0, "seed": 7, "stop": "\\n", "top_k": 5, "n": 2}',
                         CompletionRequest)
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
    for body in (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
                 b'{"messages": [], "frequency_penalty": 0.5}',
                 b'{"messages": [], "response_format": {"type": "json_object"}}'):
        with pytest.raises(APIError):
            check_unsupported(decode_request(body, ChatCompletionRequest))
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
    r = client.completions.create(model=server["model_name"], prompt=["Hello there", "Good night"], max_tokens=5,
                                  temperature=0, n=2, logprobs=2, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy choices of one prompt agree
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and len(lp.top_logprobs[0]) == 2
    if "\ufffd" not in "".join(lp.tokens):  # a lone byte of a UTF-8 character decodes as U+FFFD alone
        assert "".join(lp.tokens) == r.choices[0].text
    # seeded sampling is reproducible, choices of one request differ by seed
    a = client.completions.create(model=server["model_name"], prompt="Once", max_tokens=6, temperature=1.0, seed=3,
                                  n=2)
    b = client.completions.create(model=server["model_name"], prompt="Once", max_tokens=6, temperature=1.0, seed=3)
    assert a.choices[0].text == b.choices[0].text
    # token-id prompts and echo
    e = client.completions.create(model=server["model_name"], prompt=[19556, 665], max_tokens=2, echo=True,
                                  temperature=0)
    assert e.choices[0].text.startswith("Hello there")
    chat = client.chat.completions.create(model=server["model_name"], temperature=0, max_tokens=4, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Hi!"}])
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == 4 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    assert chat.usage.prompt_tokens > 10 and chat.usage.completion_tokens == 4
    # stop strings: cut where the third token's text first appears
    g = client.completions.create(model=server["model_name"], prompt="a b c", max_tokens=6, temperature=0, logprobs=0)
    word = g.choices[0].logprobs.tokens[2]
    if word.strip() and "\ufffd" not in word:
        st = client.completions.create(model=server["model_name"], prompt="a b c", max_tokens=6, temperature=0,
                                       stop=[word])
        assert st.choices[0].finish_reason == "stop"
        assert st.choices[0].text == g.choices[0].text[:g.choices[0].text.find(word)]


@pytest.mark.timeout(300)
def test_openai_client_streaming(server, client):
    chunks = list(client.chat.completions.create(
        model=server["model_name"], messages=[{"role": "user", "content": "Tell me"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, n=2))
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
    full = client.chat.completions.create(model=server["model_name"], messages=[{"role": "user", "content": "Tell me"}],
                                          max_tokens=5, temperature=0)
    assert full.choices[0].message.content == text[0]
    comp = list(client.completions.create(model=server["model_name"], prompt="The sky", max_tokens=4, temperature=0,
                                          stream=True))
    assert "".join(c.choices[0].text for c in comp if c.choices) == client.completions.create(
        model=server["model_name"], prompt="The sky", max_tokens=4, temperature=0).choices[0].text


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
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "word " * (MAX_LEN + 50)}],
                                       max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
        client.completions.create(model=name, prompt="word " * (MAX_LEN - 100), max_tokens=200)
    with pytest.raises(openai.BadRequestError):  # token ids outside the vocabulary: rejected by the engine
        client.completions.create(model=name, prompt=[10 ** 7], max_tokens=1)
    h = {"Authorization": f"Bearer {server['key']}", "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": [', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", content=b"x" * (2 << 20), headers=h)  # the server allows 1 MiB
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/nope", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "logit_bias": {"1": 5}}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
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
        with httpx.stream("POST", server["url"] + "/v1/completions", json={**body, "stream": True}, headers=h,
                          timeout=60) as resp:
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
    text = httpx.get(server["url"] + "/metrics").text
    samples = parse_prometheus(text)
    model = server["model_name"]
    for name in ("workbench:num_requests_running", "workbench:num_requests_waiting", "workbench:kv_cache_usage_perc",
                 "workbench:prefix_cache_hit_rate", "workbench:spec_decode_draft_acceptance_rate",
                 "workbench:generation_tokens_total", "workbench:prompt_tokens_total",
                 "workbench:time_to_first_token_seconds_bucket", "workbench:inter_token_latency_seconds_count",
                 "workbench:e2e_request_latency_seconds_sum", "workbench:request_success_total",
                 "workbench:cache_config_info"):
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
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, server["url"], server["key"], server["model_name"], "64"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
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
    cases = [('"seed": 18446744073709551616', "seed", "seed must be in"),  # 2**64: was a 500
             ('"seed": 18446744073709551615, "n": 2', "seed", "seed must be in"),  # the second choice's seed
             ('"temperature": 1e400', "temperature", "out of range"),
             ('"stop": [' + ",".join(f'"s{i}"' for i in range(17)) + "]", "stop", "at most 16"),
             ('"stop": ["' + "x" * 5000 + '"]', "stop", "at most 4096")]
    for extra, param, words in cases:
        r = httpx.post(url + "/v1/completions", headers={**h, "content-type": "application/json"},
                       content=('{"prompt": "hi", "max_tokens": 2, ' + extra + "}").encode())
        assert r.status_code == 400, (extra[:40], r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, (extra[:40], err)
    r = httpx.post(url + "/v1/completions", headers={**h, "content-type": "application/json"},
                   content=b'{"prompt": "hi", "temperature": NaN}')  # not JSON at all
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1,
                                                   "stop": ["zz"] * 16}, headers=h, timeout=60)
    assert ok.status_code == 200, ok.text  # the edges of the ranges are allowed


@pytest.mark.timeout(300)
def test_oversized_prompts_are_refused_while_a_stream_runs(server):
    url, h = server["url"], {"Authorization": f"Bearer {server['key']}"}
    body = {"prompt": "Once", "max_tokens": 800, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, headers=h, timeout=120)
    lines: list[str] = []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", headers=h, timeout=120,
                          json={**body, "stream": True, "return_token_ids": True}) as r:
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


def _own_front(tmp_path, *flags: str):
    from http_helpers import free_port, make_tiny_tokenized_model, wait_http

    model = make_tiny_tokenized_model(tmp_path / "m")
    port = free_port()
    name = f"drain-{port}"
    log = tmp_path / "front.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--http", f"127.0.0.1:{port}",
                                 "--model", str(model), "--name", name, "--http-log-level", "warning", *flags],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
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

    proc, url, name, log = _own_front(tmp_path, "--drain-timeout", "1.5", "--max-num-seqs", "1")
    try:
        body = {"prompt": "Once", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
        got = [([], []) for _ in range(4)]  # 2000 tokens each, one at a time: seconds of work
        threads = [threading.Thread(target=_sse_lines, args=(url, body, lines, st)) for lines, st in got]
        for t in threads:
            t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
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

    proc, url, name, log = _own_front(tmp_path, "--drain-timeout", "120", "--max-num-seqs", "1")
    try:
        lines, st = [], []
        t = threading.Thread(target=lambda: _ignore_errors(_sse_lines, url, {"prompt": "Once", "max_tokens": 2000,
                                                                             "ignore_eos": True}, lines, st))
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining, for up to 120 s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        t.join(30)
        assert not conn.connection_path(name).exists()  # no stale connection file
    finally:
        if proc.poll() is None:
            proc.kill()


def _ignore_errors(fn, *args):
    try:
        fn(*args)
    except httpx.HTTPError:
        pass  # the second signal cuts the stream: that is what it is for
