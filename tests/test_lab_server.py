"""The Jupyter server extension against a real engine process (a tiny random Llama).

pytest-jupyter runs a Jupyter server in-process under the base URL ``/a%40b/`` (so every URL
is checked under a prefix, as with JupyterHub); `jp_fetch` / `jp_ws_fetch` send the server's token.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time

import pytest
import tornado.httpclient
import tornado.websocket
from jupyter_helpers import private_runtime_dir, stop_engine

# pytest-jupyter's fixtures, imported so they stay local to this module: loading it as a plugin
# (pytest_plugins) would put its autouse event loop and its test-call hook on every test of the
# session (and break the Playwright browser test).
from pytest_jupyter.jupyter_server import *  # noqa: E402, F403

from workbench.ipc import connection as conn
from workbench.ipc.launch import start_engine
from workbench.sampling_params import SamplingParams
from workbench.settings import schema, setting_names


def aio(fn):
    """Run an async test on pytest-jupyter's event loop (the loop its server runs on)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if "jp_asyncio_loop" not in sig.parameters:
        params.append(inspect.Parameter("jp_asyncio_loop", inspect.Parameter.KEYWORD_ONLY))

    def test(*args, jp_asyncio_loop, **kwargs):
        if "jp_asyncio_loop" in sig.parameters:
            kwargs["jp_asyncio_loop"] = jp_asyncio_loop
        return jp_asyncio_loop.run_until_complete(fn(*args, **kwargs))

    test.__name__, test.__qualname__, test.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    test.__module__ = fn.__module__
    test.__signature__ = sig.replace(parameters=params)
    if hasattr(fn, "pytestmark"):
        test.pytestmark = fn.pytestmark
    return test


ENGINE_KW = dict(dtype="float32", num_kv_blocks=64, timeout=120)
PROMPT = [[5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module", autouse=True)
def runtime_dir(tmp_path_factory):
    with private_runtime_dir(tmp_path_factory.mktemp("lab-rt")) as d:
        yield d


@pytest.fixture(scope="module")
def engine(tiny_llama, runtime_dir):
    eng = start_engine(str(tiny_llama[0]), name="lab", **ENGINE_KW)
    yield eng
    stop_engine(eng, check=True)


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"workbench": True}}}


@pytest.fixture
def hub(jp_serverapp):
    hub = jp_serverapp.web_app.settings["workbench_hub"]
    yield hub
    hub.close(stop_started=True)  # whatever the test did, no client or spawned engine outlives it


async def fetch_json(jp_fetch, *parts, **kw):
    r = await jp_fetch("workbench", "api", *parts, **kw)
    return json.loads(r.body)


async def fetch_error(jp_fetch, *parts, **kw):
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_fetch("workbench", "api", *parts, **kw)
    return e.value.code, json.loads(e.value.response.body)


async def ws_messages(ws, until, timeout=30.0):
    """Messages from the websocket up to the first one `until(msg)` accepts."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; got {[m.get('type') for m in seen]}")
        raw = await asyncio.wait_for(ws.read_message(), left)
        assert raw is not None, "websocket closed"
        msg = json.loads(raw)
        seen.append(msg)
        if until(msg, seen):
            return seen


async def generate(engine, n=12):
    return await engine.agenerate(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=n, temperature=0))


# -- REST -----------------------------------------------------------------------------------------
@aio
async def test_schema_is_the_settings_schema(jp_fetch, hub):
    data = await fetch_json(jp_fetch, "schema")
    assert [s["name"] for s in data["settings"]] == setting_names()
    assert data["settings"] == json.loads(json.dumps(schema()))
    kinds = {s["name"]: s["kind"] for s in data["settings"]}
    assert kinds["max_num_seqs"] == "live" and kinds["quantization"] == "relayout" and kinds["dtype"] == "restart"


@aio
async def test_list_and_status(jp_fetch, hub, engine):
    data = await fetch_json(jp_fetch, "engines")
    names = {e["name"]: e for e in data["engines"]}
    assert names["lab"]["pid"] == engine.pid
    assert not names["lab"]["started_here"]
    info = await fetch_json(jp_fetch, "engines", "lab")
    for key in ("pid", "model", "device", "uptime_s"):
        assert key in info["status"]
    assert info["settings"]["max_num_seqs"] == engine.settings()["max_num_seqs"]
    assert "output_tok_s" in info["metrics"]


@aio
async def test_registered_remote_is_listed(jp_fetch, hub, engine):
    from workbench.remote import register_remote, unregister_remote

    register_remote("remote-vllm", "http://127.0.0.1:9/v1", model="some/model")
    try:
        data = await fetch_json(jp_fetch, "engines")
        names = {e["name"]: e for e in data["engines"]}
        assert names["remote-vllm"]["transport"] == "http"
        assert names["remote-vllm"]["remote_url"].startswith("http://127.0.0.1:9")
        assert names["lab"]["transport"] != "http"
    finally:
        unregister_remote("remote-vllm")


@aio
async def test_set_settings_reaches_the_engine(jp_fetch, hub, engine):
    before = engine.settings()["max_num_seqs"]
    try:
        data = await fetch_json(
            jp_fetch,
            "engines",
            "lab",
            "settings",
            method="PATCH",
            body=json.dumps({"max_num_seqs": 7, "prefix_caching": False}),
        )
        assert data["settings"]["max_num_seqs"] == 7
        assert engine.settings()["max_num_seqs"] == 7
        assert engine.settings()["prefix_caching"] is False
        got = await fetch_json(jp_fetch, "engines", "lab", "settings")
        assert got["settings"]["max_num_seqs"] == 7
    finally:
        engine.configure(max_num_seqs=before, prefix_caching=True)


@pytest.mark.parametrize(
    "changes", [{"max_num_seqs": 0}, {"batching": "fastest"}, {"no_such_setting": 1}, {"kv_cache": "yes"}]
)
@aio
async def test_engine_errors_pass_through(jp_fetch, hub, engine, changes):
    with pytest.raises((ValueError, TypeError)) as direct:
        engine.configure(**changes)
    code, body = await fetch_error(jp_fetch, "engines", "lab", "settings", method="PATCH", body=json.dumps(changes))
    assert code == 400
    assert body["message"] == str(direct.value)  # the engine's own words
    assert body["type"] == type(direct.value).__name__


@aio
async def test_bad_requests(jp_fetch, hub, engine):
    code, body = await fetch_error(jp_fetch, "engines", "nobody", "settings")
    assert code == 404 and "nobody" in body["message"]
    code, body = await fetch_error(jp_fetch, "engines", "lab", "settings", method="PATCH", body="{not json")
    assert code == 400
    code, body = await fetch_error(jp_fetch, "engines", "lab", "timeline", params={"since": "x"})
    assert code == 400


@aio
async def test_run_log_routes(jp_fetch, hub, tmp_path, monkeypatch):
    """The run log for the lab's view: the newest runs with their headline metrics, and two or more
    side by side; bad ids are refused saying what is allowed; NaN is sent as null (valid JSON)."""
    from workbench.runs import RunLog

    db = tmp_path / "runs.sqlite"
    monkeypatch.setenv("WORKBENCH_RUNS_DB", str(db))
    log = RunLog(db)
    a = log.start("sweep_point", label="a", settings={"max_num_seqs": 4})
    log.finish(a, metrics={"output_tok_s": 10.0, "ttft_p50_ms": float("nan")})
    b = log.start("sweep_point", label="b", settings={"max_num_seqs": 8})
    log.finish(b, metrics={"output_tok_s": 30.0, "ttft_p50_ms": 5.0})
    runs = (await fetch_json(jp_fetch, "runs"))["runs"]
    assert [r["id"] for r in runs] == [b, a] and runs[1]["headline"]["output_tok_s"] == 10.0
    r = await jp_fetch("workbench", "api", "runs", "compare", params={"ids": f"{a},{b}"})
    comp = json.loads(r.body)  # strict JSON: a NaN would not parse in a browser
    assert "NaN" not in r.body.decode()
    assert comp["throughput"]["value"] == [10.0, 30.0] and comp["latency"]["value"] == [None, 5.0]
    assert comp["settings"] == [{"setting": "max_num_seqs", "values": ["4", "8"]}]
    for ids, words in (("x,1", "separated by commas"), (str(a), "two or more")):
        code, body = await fetch_error(jp_fetch, "runs", "compare", params={"ids": ids})
        assert code == 400 and words in body["message"]
    code, body = await fetch_error(jp_fetch, "runs", params={"limit": "0"})
    assert code == 400 and "1..1000" in body["message"]


@aio
async def test_timeline_route(jp_fetch, hub, engine):
    first = await fetch_json(jp_fetch, "engines", "lab", "timeline")
    await generate(engine, 6)
    data = await fetch_json(jp_fetch, "engines", "lab", "timeline", params={"since": first["cursor"]})
    assert data["cursor"] > first["cursor"]
    assert {s["phase"] for s in data["steps"]} >= {"prefill", "decode"}
    assert all(s["seq"] > first["cursor"] for s in data["steps"])
    assert {r["kind"] for r in data["requests"]} >= {"arrived", "first_token", "finished"}


@aio
async def test_bokeh_served_from_the_installed_package(jp_fetch, hub):
    import bokeh

    r = await jp_fetch("workbench", "static", "bokeh", "bokeh.min.js")
    assert r.code == 200 and bokeh.__version__.encode() in r.body
    info = await fetch_json(jp_fetch, "info")
    assert info["bokeh"] == bokeh.__version__
    # kernels this server starts are told where: bokeh's own server layout, offline
    from workbench.bokehjs import BOKEH_ROOT_ENV, bokeh_resources

    root = os.environ[BOKEH_ROOT_ENV]
    assert root.endswith("/workbench/bokeh/")
    files = bokeh_resources().js_files
    assert files and all(f.startswith(root) and "cdn" not in f for f in files)
    for url in files:
        parts = url.removeprefix(root).split("/")
        r = await jp_fetch("workbench", "bokeh", *parts)
        assert r.code == 200 and b"Bokeh" in r.body[:2000], url


@aio
async def test_start_and_stop_an_engine(jp_fetch, hub, engine, tiny_llama):
    code, body = await fetch_error(
        jp_fetch, "engines", method="POST", body=json.dumps({"name": "spawned", "settings": {"batching": "fastest"}})
    )
    assert code == 400 and "batching" in body["message"]
    assert conn.live_engine("spawned") is None  # rejected before spawning
    code, body = await fetch_error(jp_fetch, "engines", method="POST", body=json.dumps({"name": "lab"}))
    assert code == 409  # the name is taken

    data = await fetch_json(
        jp_fetch,
        "engines",
        method="POST",
        request_timeout=120,
        body=json.dumps(
            {"name": "spawned", "model": str(tiny_llama[0]), "settings": {"dtype": "float32", "num_kv_blocks": 32}}
        ),
    )
    assert data["name"] == "spawned"
    pid = data["status"]["pid"]
    listed = {e["name"]: e for e in (await fetch_json(jp_fetch, "engines"))["engines"]}
    assert listed["spawned"]["started_here"] and listed["spawned"]["pid"] == pid
    r = await jp_fetch("workbench", "api", "engines", "spawned", method="DELETE", request_timeout=60)
    assert json.loads(r.body)["state"] == "stopped"
    assert not conn.pid_alive(pid)
    names = [e["name"] for e in (await fetch_json(jp_fetch, "engines"))["engines"]]
    assert "spawned" not in names and "lab" in names


# -- websocket ------------------------------------------------------------------------------------
@aio
async def test_events_snapshot_then_deltas(jp_ws_fetch, hub, engine):
    ws = await jp_ws_fetch("workbench", "api", "engines", "lab", "events", params={"rate": "20"})
    try:
        [snap] = await ws_messages(ws, lambda m, _: True)
        assert snap["type"] == "snapshot" and snap["engine"] == "lab"
        assert snap["settings"]["max_num_seqs"] == engine.settings()["max_num_seqs"]
        assert snap["status"]["pid"] == engine.pid
        cursor = snap["timeline"]["cursor"]

        task = asyncio.ensure_future(generate(engine, 10))
        phases, kinds, seqs = set(), set(), []

        def done(msg, _):
            assert msg["type"] == "delta"
            for s in msg.get("timeline", {}).get("steps", []):
                phases.add(s["phase"])
                seqs.append(s["seq"])
            for r in msg.get("timeline", {}).get("requests", []):
                kinds.add(r["kind"])
                seqs.append(r["seq"])
            return {"prefill", "decode"} <= phases and "finished" in kinds

        await ws_messages(ws, done)
        await task
        assert min(seqs) > cursor and len(seqs) == len(set(seqs))  # only new events, each once

        # a settings change made elsewhere arrives as a delta
        before = engine.settings()["max_num_seqs"]
        engine.configure(max_num_seqs=5)
        try:
            msgs = await ws_messages(ws, lambda m, _: "max_num_seqs" in m.get("changes", {}))
            assert msgs[-1]["settings"]["max_num_seqs"] == 5
        finally:
            engine.configure(max_num_seqs=before)
        assert "status" not in msgs[-1]  # max_num_seqs does not change which kernels serve
        # a change of what may serve (cpu_kernels) brings status again: the panel's kernels row follows
        on = engine.settings()["cpu_kernels"]
        engine.configure(cpu_kernels=not on)
        try:
            msgs = await ws_messages(ws, lambda m, _: "status" in m)
            assert "cpu_kernels" in msgs[-1]["changes"]
            assert {k: msgs[-1]["status"][k] for k in ("cpu_kernels", "kernel_variant", "attention_backend")} == {
                k: engine.status()[k] for k in ("cpu_kernels", "kernel_variant", "attention_backend")
            }
        finally:
            engine.configure(cpu_kernels=on)
        # metrics arrive about once a second
        msgs = await ws_messages(ws, lambda m, _: "metrics" in m, timeout=5)
        assert "kv_usage" in msgs[-1]["metrics"]
    finally:
        ws.close()


@aio
async def test_relayout_progress_is_relayed(jp_fetch, jp_ws_fetch, hub, engine):
    ws = await jp_ws_fetch("workbench", "api", "engines", "lab", "events", params={"rate": "20"})
    try:
        await ws_messages(ws, lambda m, _: m["type"] == "snapshot")
        states = []

        def done(msg, _):
            states.extend(r["state"] for r in msg.get("relayout", []) if r.get("setting") == "quantization")
            return "done" in states

        await fetch_json(
            jp_fetch,
            "engines",
            "lab",
            "settings",
            method="PATCH",
            request_timeout=120,
            body=json.dumps({"quantization": "int8"}),
        )
        await ws_messages(ws, done, timeout=60)
        assert states[0] == "started"
        out = await generate(engine, 4)  # still serving after the re-layout
        assert len(out[0].token_ids) == 4
    finally:
        ws.close()
        engine.configure(quantization="none")


@aio
async def test_events_are_coalesced_at_the_chosen_rate(jp_ws_fetch, hub, engine):
    ws = await jp_ws_fetch("workbench", "api", "engines", "lab", "events", params={"rate": "2"})
    try:
        await ws_messages(ws, lambda m, _: m["type"] == "snapshot")
        task = asyncio.ensure_future(generate(engine, 120))
        times = []

        def done(msg, _):
            times.append(time.monotonic())
            return any(r["kind"] == "finished" for r in msg.get("timeline", {}).get("requests", []))

        msgs = await ws_messages(ws, done, timeout=60)
        await task
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(g > 0.35 for g in gaps), gaps  # 2 Hz, with some scheduling slack
        steps = sum(len(m.get("timeline", {}).get("steps", [])) for m in msgs)
        assert steps >= 120 and steps > 2 * len(msgs)  # many steps per message
        # the rate can be changed on the fly
        ws.write_message(json.dumps({"rate": 50}))
    finally:
        ws.close()


@aio
async def test_events_end_when_the_engine_stops(jp_fetch, jp_ws_fetch, hub, tiny_llama):
    data = await fetch_json(
        jp_fetch,
        "engines",
        method="POST",
        request_timeout=120,
        body=json.dumps(
            {"name": "short", "model": str(tiny_llama[0]), "settings": {"dtype": "float32", "num_kv_blocks": 16}}
        ),
    )
    assert data["name"] == "short"
    ws = await jp_ws_fetch("workbench", "api", "engines", "short", "events", params={"rate": "0.5"})
    try:
        await ws_messages(ws, lambda m, _: m["type"] == "snapshot")
        await jp_fetch("workbench", "api", "engines", "short", method="DELETE", request_timeout=60)
        t0 = time.monotonic()
        msgs = await ws_messages(ws, lambda m, _: m.get("engine", {}).get("state") in ("stopped", "dead"))
        assert time.monotonic() - t0 < 1.9  # not held back by the 0.5 Hz rate
        assert msgs[-1]["type"] == "delta"
        assert await asyncio.wait_for(ws.read_message(), 10) is None  # then the server closes it
    finally:
        ws.close()


@aio
async def test_events_unknown_engine_refused(jp_ws_fetch, hub):
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await jp_ws_fetch("workbench", "api", "engines", "nobody", "events")
    assert e.value.code == 404


# -- authentication -------------------------------------------------------------------------------
ROUTES = [
    ("GET", "workbench/api/info", None),
    ("GET", "workbench/api/schema", None),
    ("GET", "workbench/api/engines", None),
    ("POST", "workbench/api/engines", {"name": "x"}),
    ("GET", "workbench/api/engines/lab", None),
    ("DELETE", "workbench/api/engines/lab", None),
    ("GET", "workbench/api/engines/lab/settings", None),
    ("PATCH", "workbench/api/engines/lab/settings", {"max_num_seqs": 3}),
    ("POST", "workbench/api/engines/lab/settings", {"max_num_seqs": 3}),
    ("GET", "workbench/api/engines/lab/timeline", None),
    ("GET", "workbench/static/bokeh/bokeh.min.js", None),
    ("GET", "workbench/api/runs", None),
    ("GET", "workbench/api/runs/compare", None),
]


@aio
async def test_every_route_refused_without_a_token(jp_fetch, jp_ws_fetch, hub, engine):
    before = engine.settings()
    for method, path, body in ROUTES:
        kw = {"body": json.dumps(body)} if body is not None else {}
        if method in ("POST", "PATCH") and body is None:
            kw["body"] = "{}"
        for headers in ({"Authorization": ""}, {"Authorization": "token wrong"}):
            with pytest.raises(tornado.httpclient.HTTPClientError) as e:
                await jp_fetch(*path.split("/"), method=method, headers=headers, follow_redirects=False, **kw)
            assert e.value.code in (401, 403), (method, path, e.value.code)
    for headers in ({"Authorization": ""}, {"Authorization": "token wrong"}):
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            await jp_ws_fetch("workbench", "api", "engines", "lab", "events", headers=headers)
        assert e.value.code in (401, 403)
    assert engine.settings() == before
    assert conn.live_engine("lab") is not None  # the DELETE did nothing
    # and the same routes answer with the token
    r = await jp_fetch("workbench", "api", "engines", "lab", "settings")
    assert r.code == 200


@aio
async def test_first_snapshot_is_a_bounded_window_and_pages_back(jp_ws_fetch, hub, engine):
    from workbench.jupyter_server.coalesce import SNAPSHOT_STEPS

    for _ in range(3):  # more steps than a first snapshot holds (each request within the context)
        await engine.agenerate(
            prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        )
    ws = await jp_ws_fetch("workbench", "api", "engines", "lab", "events", params={"rate": "20"})
    try:
        raw = await asyncio.wait_for(ws.read_message(), 30)
        snap = json.loads(raw)
        assert snap["type"] == "snapshot" and snap["window"] == SNAPSHOT_STEPS and snap["older"] is True
        assert len(snap["timeline"]["steps"]) == SNAPSHOT_STEPS
        assert len(raw) < 400_000  # was 2.6 MB with a long history
        newest = snap["timeline"]["steps"][-1]["seq"]
        ws.write_message(json.dumps({"history": 4 * SNAPSHOT_STEPS}))
        [wider] = (await ws_messages(ws, lambda m, _: m["type"] == "snapshot"))[-1:]
        assert wider["window"] == 4 * SNAPSHOT_STEPS
        steps = wider["timeline"]["steps"]
        assert len(steps) > SNAPSHOT_STEPS + 100 and steps[-1]["seq"] >= newest  # reaches further back
        assert [s["seq"] for s in steps] == sorted({s["seq"] for s in steps})
        ws.write_message(json.dumps({"history": 10**12}))  # clamped, not obeyed
        [clamped] = (await ws_messages(ws, lambda m, _: m["type"] == "snapshot"))[-1:]
        from workbench.jupyter_server.coalesce import MAX_HISTORY_STEPS

        assert clamped["window"] == MAX_HISTORY_STEPS
    finally:
        ws.close()


@aio
async def test_events_socket_refuses_a_foreign_origin(jp_fetch, jp_serverapp, jp_http_port, jp_base_url, hub, engine):
    """A page on another site cannot open the events socket with the user's login cookie (a
    token in a header cannot be sent by such a page, so only cookie logins are checked)."""
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest
    from tornado.websocket import websocket_connect

    base = f"127.0.0.1:{jp_http_port}{jp_base_url}"  # jp_fetch: the fixture that starts the server
    http = AsyncHTTPClient()
    # Log in as a browser does: the login page's xsrf cookie, then the token as the password.
    page = await http.fetch(f"http://{base}login")
    jar = {c.split("=", 1)[0]: c.split(";", 1)[0] for c in page.headers.get_list("Set-Cookie")}
    body = f"_xsrf={jar['_xsrf'].split('=', 1)[1]}&password={jp_serverapp.identity_provider.token}"
    login = await http.fetch(
        f"http://{base}login",
        method="POST",
        body=body,
        follow_redirects=False,
        raise_error=False,
        headers={"Cookie": "; ".join(jar.values())},
    )
    assert login.code == 302, login.code
    jar.update({c.split("=", 1)[0]: c.split(";", 1)[0] for c in login.headers.get_list("Set-Cookie")})
    cookies = "; ".join(jar.values())
    url = f"ws://{base}workbench/api/engines/lab/events"
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await websocket_connect(HTTPRequest(url, headers={"Cookie": cookies, "Origin": "http://evil.example"}))
    assert e.value.code == 403
    ws = await websocket_connect(
        HTTPRequest(url, headers={"Cookie": cookies, "Origin": f"http://{base.split('/')[0]}"})
    )
    try:  # the same cookie from the server's own origin is let in
        assert json.loads(await asyncio.wait_for(ws.read_message(), 30))["type"] == "snapshot"
    finally:
        ws.close()


# A kernel client that floods the kernel's output, then freezes: it reads nothing and answers no
# close frame, as a page does that is being closed or is reloaded while its kernel still prints.
FROZEN_KERNEL_CLIENT = r"""
import asyncio, sys, time
from jupyter_client.session import Session
from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1
from tornado.websocket import websocket_connect

async def main():
    ws = await websocket_connect(sys.argv[1], subprotocols=["v1.kernel.websocket.jupyter.org"])
    session = Session()
    code = "import time\nt = time.time()\nwhile time.time() - t < 8: print('x' * 50, flush=True)"
    msg = session.msg("execute_request", {"code": code, "silent": False, "store_history": False,
                                          "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    await ws.write_message(serialize_msg_to_ws_v1(msg, "shell", session.pack), binary=True)
    for _ in range(50):
        await ws.read_message()
    print("flooding", flush=True)
    time.sleep(10)

asyncio.run(main())
"""


@aio
async def test_a_kernel_socket_closed_while_its_kernel_prints_logs_no_traceback(
    jp_fetch, jp_serverapp, jp_http_port, jp_base_url, hub
):
    """A second connection for the same kernel session makes the server close the first; while
    tornado waits for that client's close frame, the kernel's output for it keeps coming. The
    server drops it quietly (jupyter_server alone logged a WebSocketClosedError traceback for each
    message) and the new connection is served."""
    import logging
    import sys
    import uuid

    from tornado.websocket import websocket_connect

    class Errors(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    errors = Errors()
    loggers = [jp_serverapp.log, logging.getLogger("tornado"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel = json.loads(r.body)["id"]
    token = jp_serverapp.identity_provider.token
    url = (
        f"ws://127.0.0.1:{jp_http_port}{jp_base_url}api/kernels/{kernel}/channels"
        f"?session_id={uuid.uuid4()}&token={token}"
    )
    frozen = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FROZEN_KERNEL_CLIENT, url, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert (await asyncio.wait_for(frozen.stdout.readline(), 90)).strip() == b"flooding"
        newer = await websocket_connect(url, subprotocols=["v1.kernel.websocket.jupyter.org"])
        try:
            await asyncio.sleep(3)  # the old socket closing, the kernel still printing for it
            assert await asyncio.wait_for(newer.read_message(), 30) is not None  # the newer one is served
        finally:
            newer.close()
    finally:
        frozen.kill()
        await frozen.wait()
        for logger in loggers:
            logger.removeHandler(errors)
        await jp_fetch("api", "kernels", kernel, method="DELETE")
    seen = [f"{r.getMessage()}: {r.exc_info[1]!r}" if r.exc_info else r.getMessage() for r in errors.records]
    assert not seen, "\n".join(seen[:5])


@aio
async def test_a_websocket_write_failing_as_its_socket_closes_is_dropped_quietly():
    """A write that starts on an open socket and fails when the peer goes away fails in the future
    tornado returns, which jupyter_server never awaits: asyncio logged "Task exception was never
    retrieved" with a traceback in the lab's log (seen in a full run). The kernel socket's writes
    retrieve it. Real sockets: a tornado server whose client vanishes during a 32 MB message."""
    import gc
    import logging

    import tornado.web
    from tornado.websocket import WebSocketHandler, websocket_connect

    from workbench.jupyter_server.kernel_socket import dropping_when_closed

    opened: asyncio.Queue = asyncio.Queue()

    class Echo(WebSocketHandler):
        def open(self):
            opened.put_nowait(self)

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    seen, log = Records(), logging.getLogger("test-kernel-socket")
    log.setLevel(logging.DEBUG)
    log.addHandler(seen)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(seen)
    server = tornado.web.Application([(r"/ws", Echo)]).listen(0, "127.0.0.1")
    port = next(iter(server._sockets.values())).getsockname()[1]
    try:
        client = await websocket_connect(f"ws://127.0.0.1:{port}/ws")
        handler = await asyncio.wait_for(opened.get(), 10)
        write = dropping_when_closed(handler.write_message, log, "kernel k")
        pending = write(b"x" * (32 << 20), binary=True)
        assert pending is not None and not pending.done()  # still being sent...
        client.protocol.stream.close()  # ...when the peer goes away
        await asyncio.wait([pending], timeout=10)  # (waits without retrieving the outcome)
        assert pending.done()  # failed (not read here: asyncio would complain if nobody did)
        del pending
        gc.collect()
        await asyncio.sleep(0.1)
        assert write(b"late") is None  # closed: dropped at once
    finally:
        server.stop()
        log.removeHandler(seen)
        asyncio_log.removeHandler(seen)
    assert not [m for m in seen.messages if "never retrieved" in m], seen.messages
    assert "kernel k: message dropped, its websocket closed while it was sent" in seen.messages
    assert "kernel k: message dropped, its websocket is closing" in seen.messages
