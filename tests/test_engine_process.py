"""The engine as a separate, shared process: real processes, real sockets, a tiny model.

Every blocking wait has a timeout, every spawned process is killed in a finalizer, and the
runtime directory is a private tmp dir (WORKBENCH_RUNTIME_DIR), so a failing test fails fast
and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import zmq
from jupyter_helpers import private_runtime_dir, stop_engine, wait_for

from workbench.errors import EngineBusyError, EngineConnectError, EngineDeadError, EngineStartError
from workbench.ipc import connection as conn
from workbench.ipc.client import EngineClient
from workbench.ipc.launch import start_engine
from workbench.ipc.protocol import (
    HEADER,
    MAGIC,
    Abort,
    Call,
    Failure,
    NewRequest,
    ProtocolError,
    Rejected,
    Stop,
    Submit,
    decode_engine_message,
    encode,
)
from workbench.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 20, 30, 40, 50], [1, 100, 3], [1, 7, 7, 7, 8, 9, 10, 11], [1, 250, 251, 252]]
ENGINE_KW = dict(dtype="float32", num_kv_blocks=64, timeout=120)
GREEDY = SamplingParams(max_tokens=12, temperature=0)

# A client in another process: `python -c WORKER <mode> <engine name> <args...>`.
WORKER = r"""
import json, sys
from workbench.ipc.client import EngineClient
from workbench.sampling_params import SamplingParams
mode, name = sys.argv[1], sys.argv[2]
eng = None if mode == "starter" else EngineClient.connect(name, timeout=30)
if mode == "generate":
    prompts, max_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
    outs = eng.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=max_tokens, temperature=0),
                        timeout=90)
    print(json.dumps([o.token_ids for o in outs]), flush=True)
elif mode == "starter":  # starts its own engine, then waits to be killed
    from workbench.ipc.launch import start_engine
    eng = start_engine(sys.argv[3], name=name, dtype="float32", num_kv_blocks=16, timeout=120)
    print("READY", eng.pid, flush=True)
    sys.stdin.read()
elif mode == "hog":
    n, max_tokens = int(sys.argv[3]), int(sys.argv[4])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    streams = [eng.stream(prompt_token_ids=[1, 5, 6, 7], params=params) for _ in range(n)]
    first = next(iter(streams[0]))
    print("STREAMING", first.request_id, flush=True)
    for chunk in streams[0]:
        pass
"""


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def runtime_dir(tmp_path_factory):
    with private_runtime_dir(tmp_path_factory.mktemp("rt")) as d:
        yield d


class Procs:
    """Every process a test spawns, killed at teardown whatever happened."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def add(self, p: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(p)
        return p

    def worker(self, *args: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return self.add(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, *map(str, args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


@pytest.fixture(scope="module")
def model_path(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module")
def reference(model_path):
    from workbench.llm import LLM

    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=64)
    cache = {}

    def ref(prompts, max_tokens=12):
        key = (json.dumps(prompts), max_tokens)
        if key not in cache:
            outs = llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=max_tokens, temperature=0))
            cache[key] = [o.token_ids for o in outs]
        return cache[key]

    ref.llm = llm
    return ref


@pytest.fixture(scope="module")
def engine(model_path):
    eng = start_engine(str(model_path), name="shared", client_timeout=4.0, max_message_mb=4, **ENGINE_KW)
    yield eng
    stop_engine(eng)


def _events_until(sub, kind: str, pred=lambda ev: True, timeout: float = 10.0) -> list:
    """Events from `sub` up to and including the first `kind` event matching `pred`."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind!r} event within {timeout}s; saw {[e.kind for e in seen]}")
        ev = sub.get(timeout=left)
        seen.append(ev)
        if ev.kind == kind and pred(ev):
            return seen


def _next_event(sub, kind: str, pred=lambda ev: True, timeout: float = 10.0):
    return _events_until(sub, kind, pred, timeout)[-1]


# -- serving ------------------------------------------------------------------------------------
def test_status_and_private_files(engine, runtime_dir, reference):
    st = engine.status()
    for key in ("pid", "model", "device", "uptime_s", "weights_checksum"):
        assert key in st
    assert st["pid"] == engine.process.pid and st["device"] == "cpu" and st["uptime_s"] >= 0
    assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    cf = runtime_dir / "shared.json"
    assert stat.S_IMODE(cf.stat().st_mode) == 0o600
    info = json.loads(cf.read_text())
    assert info["transport"] == "ipc" and info["request_address"].startswith("ipc://") and info["curve"] is None
    assert engine.settings()["num_kv_blocks"] == 64
    assert engine.weights_checksum() == st["weights_checksum"]
    # a re-layout does not restart the clock: uptime is the process's
    engine.configure(quantization="int8")
    try:
        assert engine.status()["uptime_s"] >= st["uptime_s"]
    finally:
        engine.configure(quantization="none")
    ids = [1, 5, 6, 7, 8]
    assert engine.score(ids) == pytest.approx(reference.llm.engine.score(ids), abs=1e-4)
    assert engine.score([5]) == [] == reference.llm.engine.score([5])  # nothing follows one token (was an IndexError)
    with EngineClient.connect("shared", timeout=10) as other:  # closes, does not stop the engine
        assert other.status()["pid"] == st["pid"]
    assert engine.status()["pid"] == st["pid"]


def test_many_clients_threads_and_processes_match_llm(engine, reference, procs):
    """Clients in threads (own clients, one shared client, asyncio) and in two other processes
    generate at once; every output equals the in-process LLM's greedy output."""
    jobs = {i: [PROMPTS[i % len(PROMPTS)], PROMPTS[(i + 1) % len(PROMPTS)]] for i in range(8)}
    expected = {i: reference(p, 12) for i, p in jobs.items()}
    workers = {i: procs.worker("generate", "shared", json.dumps(jobs[i]), 12) for i in (6, 7)}

    def own_client(i):
        with EngineClient.connect("shared", timeout=20) as c:
            return [o.token_ids for o in c.generate(prompt_token_ids=jobs[i], params=GREEDY, timeout=60)]

    def shared_client(i):
        return [o.token_ids for o in engine.generate(prompt_token_ids=jobs[i], params=GREEDY, timeout=60)]

    def streamed(i):
        out = []
        for p in jobs[i]:
            chunks = list(engine.stream(prompt_token_ids=p, params=GREEDY, timeout=60))
            assert chunks[-1].finish_reason is not None and chunks[-1].output is not None
            assert [t for c in chunks for t in c.token_ids_delta] == chunks[-1].output.token_ids
            out.append(chunks[-1].output.token_ids)
        return out

    def async_client(i):
        async def go():
            outs = await engine.agenerate(prompt_token_ids=[jobs[i][0]], params=GREEDY, timeout=60)
            toks = [
                t
                async for c in engine.astream(prompt_token_ids=jobs[i][1], params=GREEDY, timeout=60)
                for t in c.token_ids_delta
            ]
            return [outs[0].token_ids, toks]

        return asyncio.run(go())

    kinds = [own_client, own_client, shared_client, shared_client, streamed, async_client]
    with ThreadPoolExecutor(len(kinds)) as ex:
        futs = {i: ex.submit(kind, i) for i, kind in enumerate(kinds)}
        got = {i: f.result(timeout=120) for i, f in futs.items()}
    for i, p in workers.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        got[i] = json.loads(out.strip().splitlines()[-1])
    assert got == expected


def test_outputs_go_only_to_the_requester(engine):
    with EngineClient.connect("shared", timeout=10) as other:
        # A client that submitted nothing receives nothing: its sink table stays empty and no
        # stray chunk reaches it while `engine` generates.
        seen = []
        orig = other._dispatch

        def spy(frames):
            seen.append(decode_engine_message(frames[1]))
            orig(frames)

        other._dispatch = spy
        engine.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY, timeout=60)
        other.settings()  # one round trip, so anything in flight would have arrived
        assert not [m for m in seen if type(m).__name__ == "Outputs"]


@pytest.mark.parametrize(
    "name,value,default",
    [
        ("batching", "static", "continuous"),
        ("batching", "off", "continuous"),
        ("max_num_seqs", 1, 64),
        ("max_num_batched_tokens", 16, 1024),
        ("kv_cache", False, True),
        ("prefix_caching", False, True),
        ("attention_backend", "torch", "auto"),
        ("kv_cache_dtype", "int8", "auto"),
        ("async_scheduling", True, False),
    ],
)
def test_configure_mid_stream(engine, reference, name, value, default):
    """Another client changes a live setting while two streams run: they continue, stay
    correct (greedy), and every client sees the change event."""
    from workbench.ipc.connection import default_client_name

    prompts = [PROMPTS[0], PROMPTS[2]]
    with EngineClient.connect("shared", timeout=10) as a, EngineClient.connect("shared", timeout=10) as b:
        try:
            # A loaded machine can delay the change past the end of short streams; then the
            # streams are made longer and the change is tried again.
            for max_tokens in (32, 96, 192) if name == "kv_cache" else (64, 192, 480):
                results, events = _configure_during_streams(engine, a, b, prompts, max_tokens, name, value)
                changed_at = events[0][-1].time
                if all(c[-1].output.metrics.first_token < changed_at < c[-1].output.metrics.finished for c in results):
                    break
                b.configure(**{name: default})
            else:
                pytest.fail("the change never landed while the streams ran")
            for evs in events:  # one list per client, each ending with the change
                assert evs[-1].data["changes"] == {name: value} and evs[-1].data["settings"][name] == value
                assert evs[-1].data["by"] == f"{default_client_name()} (pid {os.getpid()})"
                if name == "kv_cache_dtype":
                    assert [e.data["state"] for e in evs if e.kind == "relayout"] == ["started", "done"]
            # on the timeline too: old -> new, and who made it
            mark = [c for c in a.timeline().changes if name in c.changes][-1]
            assert mark.changes == {name: [default, value]} and mark.by == events[0][-1].data["by"]
            expected = reference(prompts, max_tokens)
            for chunks, exp in zip(results, expected):
                out = chunks[-1].output
                assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
                assert [t for c in chunks for t in c.token_ids_delta] == out.token_ids
                if name != "kv_cache_dtype":  # int8 KV may differ slightly; it must complete
                    assert out.token_ids == exp
            assert a.settings()[name] == value
        finally:
            b.configure(**{name: default})
    assert engine.settings()[name] == default


def _configure_during_streams(engine, a, b, prompts, max_tokens, name, value):
    """Client `a` streams the prompts while `b` configures; returns each stream's chunks and,
    per client (a, b, engine), its events up to the settings change."""
    subs = [c.events(["settings", "relayout"]) for c in (a, b, engine)]
    started = [threading.Event() for _ in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def consume(i):
        chunks = []
        for c in a.stream(prompt_token_ids=prompts[i], params=params, timeout=120):
            chunks.append(c)
            started[i].set()
        return chunks

    try:
        with ThreadPoolExecutor(len(prompts)) as ex:
            futs = [ex.submit(consume, i) for i in range(len(prompts))]
            for ev in started:
                assert ev.wait(60), "streams did not start"
            effective = b.configure(**{name: value})
            results = [f.result(timeout=180) for f in futs]
        assert effective[name] == value
        events = [_events_until(sub, "settings", lambda e: e.data["changes"].get(name) == value) for sub in subs]
    finally:
        for sub in subs:
            sub.close()
    return results, events


def test_engine_errors_keep_type_and_message(engine, reference):
    llm = reference.llm

    def local_error(fn):
        with pytest.raises((ValueError, TypeError)) as info:
            fn()
        return type(info.value), str(info.value)

    cases = [
        (lambda: llm.configure(nope=1), lambda: engine.configure(nope=1)),
        (lambda: llm.configure(batching="fast"), lambda: engine.configure(batching="fast")),
        (lambda: llm.configure(max_num_seqs="many"), lambda: engine.configure(max_num_seqs="many")),
        (lambda: llm.configure(kv_cache=1), lambda: engine.configure(kv_cache=1)),
        (lambda: llm.configure(block_size=32), lambda: engine.configure(block_size=32)),
        (
            lambda: llm.generate(prompt_token_ids=[[1, 999]], params=GREEDY),
            lambda: engine.generate(prompt_token_ids=[[1, 999]], params=GREEDY, timeout=30),
        ),
        (
            lambda: llm.generate(prompt_token_ids=[[1] * 600], params=GREEDY),
            lambda: engine.generate(prompt_token_ids=[[1] * 600], params=GREEDY, timeout=30),
        ),
        (lambda: llm.generate("hello", GREEDY), lambda: engine.generate("hello", GREEDY, timeout=30)),
        (
            lambda: list(llm.stream(prompt_token_ids=[1, 300], params=GREEDY)),
            lambda: list(engine.stream(prompt_token_ids=[1, 300], params=GREEDY, timeout=30)),
        ),
        (
            lambda: llm.generate(prompt_token_ids=[[1, 2]], params={"max_tokens": 0}),
            lambda: engine.generate(prompt_token_ids=[[1, 2]], params={"max_tokens": 0}),
        ),
    ]
    for local, remote in cases:
        assert local_error(remote) == local_error(local)
    with pytest.raises(ValueError, match="unknown method"):
        engine.call("no_such_method")
    with pytest.raises(TypeError):
        engine.timeline(since="yesterday")
    # Nothing was admitted by the failed batch (one bad prompt rejects the whole submit).
    with pytest.raises(ValueError):
        engine.generate(prompt_token_ids=[[1, 2, 3], [1, 999]], params=GREEDY, timeout=30)
    assert engine.metrics()["num_waiting"] == 0 and engine.metrics()["num_running"] == 0
    assert (
        engine.generate(prompt_token_ids=PROMPTS[:1], params=GREEDY, timeout=30)[0].token_ids
        == reference(PROMPTS[:1])[0]
    )


def test_abort_and_early_exit_free_blocks(engine):
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    it = engine.stream(prompt_token_ids=PROMPTS[0], params=params, timeout=60)
    first = next(it)
    with EngineClient.connect("shared", timeout=10) as other:
        other.abort(first.request_id)  # any client may abort by id; the owner sees "abort"
    last = [first, *it][-1]
    assert last.finish_reason == "abort" and last.output.finish_reason == "abort"
    it2 = engine.stream(prompt_token_ids=PROMPTS[1], params=params, timeout=60)
    next(it2)
    it2.close()  # leaving a stream early aborts its request
    wait_for(
        lambda: engine.metrics()["kv_blocks_used"] == 0 and engine.metrics()["num_running"] == 0,
        10,
        "KV blocks to be freed",
    )


def test_events_stream_steps_and_request_lifecycle(engine):
    got = []
    with engine.events(["timeline", "metrics"]) as sub, engine.on_event(got.append, kinds="timeline") as cb:
        [out] = engine.generate(prompt_token_ids=[PROMPTS[3]], params=GREEDY, timeout=60)
        rid = out.request_id
        kinds: set[str] = set()
        steps = 0
        deadline = time.monotonic() + 10
        while ("finished" not in kinds or steps == 0) and time.monotonic() < deadline:
            ev = sub.get(timeout=max(0.1, deadline - time.monotonic()))
            if ev.kind == "timeline":
                kinds |= {r.kind for r in ev.data.requests if r.request_id == rid}
                steps += sum(any(b.request_id == rid for b in s.batch) for s in ev.data.steps)
        assert {"arrived", "scheduled", "first_token", "finished"} <= kinds
        assert steps >= 1
        _next_event(sub, "metrics", timeout=5)
        wait_for(lambda: any(r.request_id == rid for ev in got for r in ev.data.requests), 5, "callback events")
        assert cb.kinds == {"timeline"}

    async def watch():
        sub = await engine.aevents("settings")
        try:
            await engine.aconfigure(max_num_seqs=32)
            async for ev in sub:
                return ev
        finally:
            sub.close()
            await engine.aconfigure(max_num_seqs=64)

    ev = asyncio.run(asyncio.wait_for(watch(), 30))
    assert ev.kind == "settings" and ev.data["changes"] == {"max_num_seqs": 32}


def test_timeline_and_chrome_trace(engine, tmp_path):
    before = engine.timeline().cursor
    outs = engine.generate(prompt_token_ids=PROMPTS[:3], params=GREEDY, timeout=60)
    tl = engine.timeline(since=before)
    assert tl.cursor > before and tl.steps and all(s.seq > before for s in tl.steps)
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert any(e["cat"] == "step" and e["name"] in ("prefill", "decode", "mixed") for e in spans)
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    for o in outs:
        assert o.request_id in lanes
    assert {"queued", "prefill", "decode"} <= {e["name"] for e in spans if e["cat"] == "request"}
    assert engine.reset_prefix_cache() >= 0


# -- bad input ----------------------------------------------------------------------------------
def _raw_dealer(ctx, address, identity=None):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if identity:
        s.setsockopt(zmq.ROUTING_ID, identity)
    s.connect(address)
    return s


def _recv(s, timeout_ms=3000):
    if not s.poll(timeout_ms):
        return None
    frames = s.recv_multipart()
    assert frames[0] == HEADER
    return decode_engine_message(frames[1])


def test_fuzz_bad_messages_engine_keeps_serving(engine, reference, runtime_dir):
    info = conn.read_connection_file(runtime_dir / "shared.json")
    rng = random.Random(20261129)
    ctx = zmq.Context()
    s = _raw_dealer(ctx, info.request_address, b"fuzzer")
    try:
        # Targeted cases with a known answer.
        s.send_multipart([MAGIC + bytes([99]), encode(Call(7, "status"))])
        m = _recv(s)
        assert isinstance(m, Failure) and m.call_id == 7 and "protocol version mismatch" in m.error.message
        s.send_multipart([HEADER, encode(Call(8, "frobnicate"))])
        m = _recv(s)
        assert isinstance(m, Failure) and m.error.type == "ValueError" and "unknown method" in m.error.message
        s.send_multipart([HEADER, encode(Call(9, "configure", {"max_num_seqs": -3}))])
        m = _recv(s)
        assert isinstance(m, Failure) and m.error.type == "ValueError" and "max_num_seqs" in m.error.message
        s.send_multipart([HEADER, msgspec.msgpack.encode(["launch_missiles", 1])])
        assert isinstance(_recv(s), ProtocolError)
        s.send_multipart([HEADER, encode(Submit([NewRequest("fz1", prompt_token_ids=[1, 1000])]))])
        m = _recv(s)
        assert isinstance(m, Rejected) and m.request_ids == ["fz1"] and m.error.type == "ValueError"
        for params, field in (
            ({"temperature": float("nan")}, "temperature"),
            ({"top_p": float("nan")}, "top_p"),
            ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ):
            # what SamplingParams refuses to build, sent raw: the engine refuses it by the same rules
            s.send_multipart([HEADER, msgspec.msgpack.encode(["submit", [["fz3", None, [1, 2], params]]])])
            m = _recv(s)
            assert isinstance(m, Rejected) and m.request_ids == ["fz3"] and field in m.error.message, m
        s.send_multipart([HEADER, encode(Abort(["no-such-request"]))])  # ignored
        s.send_multipart([HEADER, encode(Stop("no-such-request", 3))])  # ignored
        s.send_multipart([HEADER, encode(Stop("no-such-request", -1))])  # a count below 0: undecodable
        assert isinstance(_recv(s), ProtocolError)
        s.send_multipart([b"only one frame"])
        assert isinstance(_recv(s), ProtocolError)
        # Random garbage: bytes, truncated valid messages, random frame counts, random msgpack.
        valid = [encode(Call(1, "metrics")), encode(Submit([NewRequest("fz2", prompt_token_ids=[1, 2])]))]
        answered = 0
        for _ in range(300):
            r = rng.random()
            if r < 0.3:
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
            elif r < 0.55:
                body = rng.choice(valid)
                frames = [HEADER, body[: rng.randint(0, len(body) - 1)]]
            elif r < 0.75:
                frames = [
                    HEADER,
                    msgspec.msgpack.encode(
                        [
                            rng.choice(["call", "submit", "abort", "stop", "ping", "bye", "x", 3]),
                            rng.choice([None, -1, 2**63, "s", [], [[1]], {"a": 1}, 1.5]),
                        ]
                    ),
                ]
            else:
                frames = [rng.choice([HEADER, b"WB", b"", b"WB\x00\x01"]), rng.randbytes(rng.randint(1, 200))]
            s.send_multipart(frames)
            while s.poll(0):
                s.recv_multipart()
                answered += 1
        while s.poll(500):
            s.recv_multipart()
            answered += 1
        assert answered > 100  # undecodable messages are answered with an error, not silence
        # An oversized message (limit 4 MiB here) is dropped by the socket layer.
        s.send_multipart([HEADER, b"\x00" * (5 << 20)])
        # Raw bytes straight into the ipc socket, not even ZMTP.
        path = info.request_address.removeprefix("ipc://")
        for _ in range(5):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(2)
                raw.connect(path)
                raw.sendall(rng.randbytes(rng.randint(1, 4096)))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # a truncated ZMTP greeting
            raw.settimeout(2)
            raw.connect(path)
            raw.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")
    finally:
        ctx.destroy(linger=0)
    # Still serving, still correct, nothing leaked.
    out = engine.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY, timeout=60)
    assert [o.token_ids for o in out] == reference(PROMPTS[:2])
    wait_for(
        lambda: engine.metrics()["num_running"] == 0 and engine.metrics()["num_waiting"] == 0,
        10,
        "fuzzed requests to finish",
    )
    with pytest.raises(ValueError, match="exceeds the engine's limit"):
        engine.generate(prompt_token_ids=[[255] * 500] * 5000, params=GREEDY)


def test_a_token_id_prompt_past_the_context_is_refused_before_its_ids_are_decoded(engine):
    """The transport refuses it from the array's length (a fuzzer's 500k-id prompts once left
    their decoded ints' heap behind: +11-16% RSS), in the engine's words (the count read from the
    array's header); one id less runs."""
    limit = engine.status()["max_model_len"]
    with pytest.raises(ValueError, match=f"prompt has {limit} tokens; the model's context is {limit} tokens"):
        engine.generate(prompt_token_ids=[[1] * limit], params=GREEDY, timeout=30)
    with pytest.raises(ValueError, match=f"prompt has 70000 tokens; the model's context is {limit} tokens"):
        engine.generate(prompt_token_ids=[[1, 2], [1] * 70000], params=GREEDY, timeout=30)  # array 32's header
    [out] = engine.generate(prompt_token_ids=[[1] * (limit - 1)], params=SamplingParams(max_tokens=1), timeout=60)
    assert out.finish_reason == "length"


def test_a_flood_of_calls_is_answered_and_bounded(runtime_dir):
    """A client that sends far faster than the step loop answers gets every call answered exactly
    once: past MAX_PENDING_MESSAGES waiting, with an EngineBusyError saying so at once, instead of
    the engine holding all of them (555k fuzzed messages once left it 10.4 GB resident). The loop
    is held by a 4,000-token prefill step of the embedded model while 3,000 status calls arrive;
    the prefill's own request is served as before."""
    from workbench.ipc.transport import MAX_PENDING_MESSAGES

    eng = start_engine(None, name="flood", timeout=300, max_num_batched_tokens=4096, prefix_caching=False)
    try:
        info = conn.read_connection_file(runtime_dir / "flood.json")
        long = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        with ThreadPoolExecutor(1) as pool:
            served = pool.submit(eng.generate, prompt_token_ids=[[7 + i % 900 for i in range(4000)]], params=long)
            wait_for(lambda: eng.metrics()["num_running"] == 1, 30, "the long prompt to run")
            ctx = zmq.Context()
            s = _raw_dealer(ctx, info.request_address, b"flooder")
            s.setsockopt(zmq.RCVHWM, 0)  # as EngineClient's: its libzmq takes every answer while it sends
            n = 3 * MAX_PENDING_MESSAGES
            try:
                for i in range(n):
                    s.send_multipart([HEADER, encode(Call(i, "status"))])
                answers: dict[int, list] = {}
                while len(answers) < n:
                    m = _recv(s, timeout_ms=60_000)
                    assert m is not None, f"{n - len(answers)} calls never answered"
                    answers.setdefault(m.call_id, []).append(m)
            finally:
                ctx.destroy(linger=0)
            assert [len(o.token_ids) for o in served.result(timeout=120)] == [2]
    finally:
        stop_engine(eng)
    assert all(len(a) == 1 for a in answers.values())  # each exactly once
    busy = [a[0] for a in answers.values() if isinstance(a[0], Failure)]
    assert busy and all(f.error.type == "EngineBusyError" for f in busy), busy[:3]
    assert f"at most {MAX_PENDING_MESSAGES}" in busy[0].error.message, busy[0].error.message
    assert len(busy) < n  # the calls within the bound were answered


# -- faults -------------------------------------------------------------------------------------
def test_kill_client_process_mid_stream_frees_its_kv(engine, reference, procs):
    # 200 requests of 400 tokens: far more work than fits in the 4 s the engine waits for a
    # heartbeat, so most of them are still queued or running when the client dies.
    hog = procs.worker("hog", "shared", 200, 400)
    line = hog.stdout.readline()
    assert line.startswith("STREAMING"), hog.stderr.read() if hog.poll() is not None else line
    m = engine.metrics()
    assert m["kv_blocks_used"] > 0 and m["num_running"] + m["num_waiting"] >= 2
    hog.send_signal(signal.SIGKILL)
    hog.wait(10)
    killed = time.monotonic()
    # Others are served meanwhile (after the vanished client's requests are aborted).
    out = engine.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY, timeout=60)
    assert [o.token_ids for o in out] == reference(PROMPTS[:2])
    wait_for(
        lambda: (lambda m: m["kv_blocks_used"] == 0 and m["num_running"] == 0 and m["num_waiting"] == 0)(
            engine.metrics()
        ),
        15,
        "the dead client's KV blocks to be freed",
    )
    aborted = [
        r
        for r in engine.timeline().requests
        if r.kind == "finished" and (r.detail or "").startswith("abort") and r.time > killed
    ]
    assert len(aborted) >= 50


def test_kill_engine_clients_raise(model_path, engine):
    eng = start_engine(str(model_path), name="victim", client_timeout=2.0, **ENGINE_KW)
    try:
        other = EngineClient.connect("victim", timeout=10, check_pid=False)  # heartbeat-only detection
        # Two engines side by side: different sockets, both serving.
        assert eng.info.request_address != engine.info.request_address
        assert engine.status()["name"] == "shared" and eng.status()["name"] == "victim"
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        errors: dict[str, tuple[type, float]] = {}

        def run(label, client):
            try:
                for _ in range(1000):  # keeps streaming until the engine dies
                    for _ in client.stream(prompt_token_ids=PROMPTS[0], params=params, timeout=60):
                        pass
            except Exception as e:
                errors[label] = (type(e), time.monotonic(), str(e))

        pairs = (("owner", eng), ("other", other))
        threads = [threading.Thread(target=run, args=(k, c), daemon=True) for k, c in pairs]
        for t in threads:
            t.start()
        wait_for(lambda: eng.metrics()["num_running"] >= 2, 30, "both streams to run")
        killed = time.monotonic()
        os.kill(eng.pid, signal.SIGKILL)
        for t in threads:
            t.join(15)
        assert set(errors) == {"owner", "other"}
        for label, (typ, when, msg) in errors.items():
            assert typ is EngineDeadError, (label, msg)
            assert when - killed < 8, (label, when - killed)
        with pytest.raises(EngineDeadError):
            other.status()
        other.close()
    finally:
        stop_engine(eng)
    assert eng.process.returncode == -signal.SIGKILL


def test_engine_stops_when_its_starter_dies(model_path, procs):
    """An engine started by start_engine() (not detached) goes away with the process that
    started it, e.g. a notebook kernel that is killed, instead of holding memory forever."""
    starter = procs.worker("starter", "orphan", model_path)
    line = starter.stdout.readline()
    assert line.startswith("READY"), starter.stderr.read() if starter.poll() is not None else line
    pid = int(line.split()[1])
    assert conn.pid_alive(pid) and conn.connection_path("orphan").exists()
    starter.kill()
    starter.wait(10)
    try:
        wait_for(lambda: not conn.pid_alive(pid), 20, "the orphaned engine to exit")
    finally:
        if conn.pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not conn.connection_path("orphan").exists()


def test_start_failures_surface_the_reason(model_path, tmp_path, engine):
    t0 = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        start_engine(str(tmp_path / "no-such-model"), name="broken", timeout=60)
    text = str(info.value)
    assert "not found: expected 'smollm2-135m', a Hugging Face model folder or a .gguf file" in text
    assert "no-such-model" in text and time.monotonic() - t0 < 60
    assert "Traceback" not in text  # a model not there is what it was given: said in one line
    assert not conn.connection_path("broken").exists()
    with pytest.raises(ValueError, match="batching"):
        start_engine(str(model_path), name="x", batching="fastest")  # rejected before spawning
    with pytest.raises(FileExistsError, match="already running"):
        start_engine(str(model_path), name="shared")
    with pytest.raises(FileNotFoundError, match="no engine named"):
        EngineClient.connect("nobody")


def test_tcp_needs_the_curve_keys(model_path, runtime_dir, tmp_path):
    eng = start_engine(str(model_path), name="tcp-eng", transport="tcp", **ENGINE_KW)
    ctx = zmq.Context()
    try:
        info = conn.read_connection_file(runtime_dir / "tcp-eng.json")
        assert info.request_address.startswith("tcp://127.0.0.1:") and info.curve["server_public"]
        assert eng.generate(prompt_token_ids=PROMPTS[:1], params=GREEDY, timeout=60)[0].finish_reason
        before = eng.metrics()["total_prompt_tokens"]
        # Peers without the keys: no keys at all, or a keypair the engine does not know; plus
        # a subscriber without keys. All are sent work, then given 1.5 s to get anything back.
        sub_no_keys = ctx.socket(zmq.SUB)
        sub_no_keys.setsockopt(zmq.SUBSCRIBE, b"")
        sub_no_keys.connect(info.event_address)
        intruders = []
        for keys in (None, zmq.curve_keypair()):
            s = ctx.socket(zmq.DEALER)
            if keys:
                s.curve_serverkey = info.curve["server_public"].encode()
                s.curve_publickey, s.curve_secretkey = keys
            s.connect(info.request_address)
            s.send_multipart(
                [HEADER, encode(Submit([NewRequest("intruder", prompt_token_ids=[1, 2, 3], params=GREEDY)]))]
            )
            s.send_multipart([HEADER, encode(Call(1, "shutdown"))])
            intruders.append(s)
        stripped = dict(json.loads((runtime_dir / "tcp-eng.json").read_text()), curve=None)
        (tmp_path / "nokeys.json").write_text(json.dumps(stripped))
        with pytest.raises(EngineConnectError, match="CURVE"):
            EngineClient.connect(str(tmp_path / "nokeys.json"), timeout=1.5)
        for s in intruders:
            assert not s.poll(0), "an unauthenticated peer got an answer"
        assert not sub_no_keys.poll(0), "events leaked to a peer without keys"
        assert eng.metrics()["total_prompt_tokens"] == before
        assert all(r.request_id != "intruder" for r in eng.timeline().requests)
        assert eng.status()["transport"] == "tcp"
    finally:
        ctx.destroy(linger=0)
        stop_engine(eng)


def test_graceful_shutdown_drain(model_path, runtime_dir):
    eng = start_engine(str(model_path), name="drainer", **ENGINE_KW)
    try:
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        it = eng.stream(prompt_token_ids=PROMPTS[0], params=params, timeout=60)
        first = next(it)
        with EngineClient.connect("drainer", timeout=10) as other:
            with eng.events("engine") as sub:
                other.shutdown(drain=True, timeout=60)
                assert _next_event(sub, "engine", lambda e: e.data["state"] == "stopped").data["name"] == "drainer"
        chunks = [first, *it]
        assert chunks[-1].finish_reason == "length" and len(chunks[-1].output.token_ids) == 60
        eng.process.wait(30)
        assert eng.process.returncode == 0
        assert not (runtime_dir / "drainer.json").exists()
        assert not [p for p in runtime_dir.iterdir() if p.name.startswith("drainer-")]  # socket files
        wait_for(lambda: not eng.alive, 10, "the owner client to notice the exit")
        with pytest.raises(EngineDeadError):
            eng.status()
    finally:
        stop_engine(eng)


def _cli_engine(procs, model_path, runtime_dir, name: str, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = procs.add(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workbench.cli",
                "serve",
                "--model",
                str(model_path),
                "--name",
                name,
                "--dtype",
                "float32",
                *flags,
                "--parent-pid",
                str(os.getpid()),
            ],  # dies with this process
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    )
    wait_for(lambda: (runtime_dir / f"{name}.json").exists() or p.poll() is not None, 60, "the cli engine")
    assert p.poll() is None, p.stderr.read()
    return p


def test_cli_serve_and_sigterm_drains(model_path, runtime_dir, procs):
    """SIGTERM drains: running and queued requests go on, new requests and new clients are
    refused with a clear error, and what is left at the drain deadline is aborted."""
    p = _cli_engine(
        procs,
        model_path,
        runtime_dir,
        "cli",
        "--num-kv-blocks",
        "48",
        "--max-num-seqs",
        "3",
        "--batching",
        "static",
        "--prefix_caching",
        "false",
        "--drain-timeout",
        "1.5",
    )
    with EngineClient.connect("cli", timeout=20) as c:
        s = c.settings()
        assert (s["num_kv_blocks"], s["max_num_seqs"], s["batching"], s["prefix_caching"]) == (48, 3, "static", False)
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        # 150 requests of 200 tokens, 3 at a time: 10,000 steps, far more than 1.5 s of work.
        streams = [c.stream(prompt_token_ids=PROMPTS[0], params=params, timeout=60) for _ in range(150)]
        next(streams[0])
        c.status()  # answered after the 150 submits (one connection is one queue): all were accepted
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the signal is taken between two steps
        with pytest.raises(RuntimeError, match="shutting down; it accepts no new clients"):
            EngineClient.connect("cli", timeout=10)
        with pytest.raises(RuntimeError, match="shutting down and accepts no new requests"):
            c.generate(prompt_token_ids=PROMPTS[1], params=GREEDY, timeout=30)
        lasts = [[*it][-1] for it in streams]
        reasons = [x.finish_reason for x in lasts]
        assert reasons[0] == "length" and len(lasts[0].output.token_ids) == 200  # it ran during the drain
        assert "abort" in reasons  # the rest met the deadline
        assert set(reasons) == {"length", "abort"}
    assert p.wait(30) == 0
    assert not (runtime_dir / "cli.json").exists()


def test_second_signal_stops_at_once_and_leaves_no_files(model_path, runtime_dir, procs):
    p = _cli_engine(
        procs,
        model_path,
        runtime_dir,
        "cli2",
        "--num-kv-blocks",
        "48",
        "--max-num-seqs",
        "3",
        "--batching",
        "static",
        "--drain-timeout",
        "120",
    )
    with EngineClient.connect("cli2", timeout=20) as c:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        streams = [c.stream(prompt_token_ids=PROMPTS[0], params=params, timeout=60) for _ in range(60)]
        next(streams[0])
        c.status()  # all 60 accepted before the signal
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the first signal is taken: draining (minutes of queued work, up to 120 s)
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 128 + signal.SIGTERM
        with pytest.raises(EngineDeadError):
            [*streams[-1]]
    assert not (runtime_dir / "cli2.json").exists()
    assert not [f for f in runtime_dir.iterdir() if f.name.startswith("cli2-")]  # socket files


def test_cli_help_lists_every_setting(capsys):
    from workbench.cli import main
    from workbench.settings import setting_names

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for name in setting_names():
        assert f"--{name.replace('_', '-')}" in text
    from workbench.ipc.engine_main import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "5", "--kv_cache", "off", "--num-kv-blocks", "none"])
    assert settings_from_args(args) == {"max_num_seqs": 5, "kv_cache": False, "num_kv_blocks": None}
    with pytest.raises(ValueError, match="batching"):
        settings_from_args(parser.parse_args(["--batching", "sometimes"]))


@pytest.mark.parametrize(
    "flags",
    [
        ["--quantization", "int3"],
        ["--max-num-seqs", "abc"],
        ["--http", "nowhere"],
        ["--route", "small=a", "--http", "127.0.0.1:1"],
        ["--route", "a=x,b=y", "--router", "smart", "--http", "127.0.0.1:1"],
        ["--router", "length", "--http", "127.0.0.1:1"],
        ["--route", "a=x,b=y"],
    ],
)
def test_cli_serve_with_a_bad_flag_value_says_one_line_and_exits_2(flags, runtime_dir):
    """A user's typo is one line naming the setting and what is allowed, not an engine's traceback."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = set(runtime_dir.iterdir())
    p = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "serve", *flags], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("workbench serve: "), p.stderr
    assert "Traceback" not in p.stderr and not p.stdout
    assert set(runtime_dir.iterdir()) == before  # no engine started


def test_connection_files_stale_and_private(runtime_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    sock = runtime_dir / "ghost-0000.req.sock"
    sock.write_text("")
    stale = conn.ConnectionInfo(
        name="ghost",
        pid=dead.pid,
        transport="ipc",
        request_address=f"ipc://{sock}",
        event_address=f"ipc://{runtime_dir / 'ghost-0000.evt.sock'}",
    )
    conn.write_connection_file(stale)
    assert conn.live_engine("ghost") is None and "ghost" not in [c.name for c in conn.list_engines()]
    fresh = conn.ConnectionInfo(
        name="ghost", pid=os.getpid(), transport="ipc", request_address="ipc://x", event_address="ipc://y"
    )
    path = conn.write_connection_file(fresh)  # a dead engine's file is replaced, its sockets removed
    assert conn.read_connection_file(path).pid == os.getpid() and not sock.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError, match="already running"):
        conn.write_connection_file(
            conn.ConnectionInfo(
                name="ghost", pid=dead.pid, transport="ipc", request_address="ipc://z", event_address="ipc://w"
            )
        )
    conn.remove_connection_file("ghost", os.getpid())
    assert not path.exists()
    with pytest.raises(ValueError, match="invalid engine name"):
        conn.connection_path("../etc")
    shared_dir = tmp_path / "open"
    shared_dir.mkdir(mode=0o755)
    shared_dir.chmod(0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        conn.ensure_private_dir(shared_dir)


# -- big prompts, admission, reconnection ---------------------------------------------------------
@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """An engine on a tiny model with SmolLM2's real tokenizer (context 2048)."""
    from http_helpers import make_tiny_tokenized_model

    model = make_tiny_tokenized_model(tmp_path_factory.mktemp("tok-model"))
    eng = start_engine(str(model), name="tokenized", dtype="float32", num_kv_blocks=256, timeout=120)
    yield eng
    stop_engine(eng)


def test_oversized_prompts_never_stall_other_requests(tokenized):
    """Prompts too long for the context, many in a row from another client, are refused from
    their length alone, from a prefix's tokens, or after tokenizing on the tokenizer thread,
    while a stream runs; the stream gets every token, handshakes are answered meanwhile."""
    eng = tokenized
    params = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    [alone] = eng.generate("Once upon a time", params, timeout=120)
    chunks: list = []
    runner = threading.Thread(target=lambda: chunks.extend(eng.stream("Once upon a time", params, timeout=120)))
    runner.start()
    wait_for(lambda: chunks, 30, "the stream to start")
    huge = "word " * ((4 << 20) // 5)  # 4 MiB: refused from its length
    near = "word " * (160_000 // 5)  # under the length bound (81 x 2048 characters): a prefix tells
    short = "word " * 6000  # too short for a prefix to tell: tokenized whole, then refused
    with EngineClient.connect("tokenized", timeout=10) as other:
        before = other.metrics()["total_prompt_tokens"]
        for _ in range(30):
            with pytest.raises(ValueError, match=r"at least [\d,]+ tokens .*context is 2048 tokens"):
                other.generate(huge, SamplingParams(max_tokens=1), timeout=60)
        for _ in range(3):
            with pytest.raises(ValueError, match="160,000 characters and its first [\\d,]+ alone are [\\d,]+ tokens"):
                other.generate(near, SamplingParams(max_tokens=1), timeout=60)
            with pytest.raises(ValueError, match="prompt has 6001 tokens"):
                other.generate(short, SamplingParams(max_tokens=1), timeout=60)
        with EngineClient.connect("tokenized", timeout=10) as third:  # handshakes answered meanwhile
            assert third.status()["name"] == "tokenized"
        assert other.metrics()["total_prompt_tokens"] == before  # nothing of them was admitted
    runner.join(120)
    assert chunks[-1].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids_delta] == alone.token_ids


def test_admission_refuses_while_queues_are_full(model_path):
    eng = start_engine(
        str(model_path),
        name="admission",
        dtype="float32",
        num_kv_blocks=64,
        timeout=120,
        max_num_seqs=1,
        max_queued_tokens=20,
        max_queued_chars=1000,
    )
    try:
        long = eng.stream(
            prompt_token_ids=PROMPTS[0],
            params=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
            timeout=60,
        )
        next(long)
        # admitted while at most 20 tokens wait: the fifth makes it 25
        queued = [eng.stream(prompt_token_ids=[1, 2, 3, 4, 5], params=GREEDY, timeout=60) for _ in range(5)]
        wait_for(lambda: eng.metrics()["num_waiting"] == 5, 10, "five requests to wait")
        with pytest.raises(EngineBusyError, match="25 prompt tokens wait to run .limit 20.; retry later"):
            eng.generate(prompt_token_ids=PROMPTS[1], params=GREEDY, timeout=30)
        for it in queued:
            it.close()  # leaving a stream aborts its request
        wait_for(lambda: eng.metrics()["num_waiting"] == 0, 10, "the queue to empty")
        out = eng.generate(prompt_token_ids=PROMPTS[1], params=GREEDY, timeout=30)  # admitted again
        assert out[0].finish_reason == "length"
        long.close()
    finally:
        stop_engine(eng)


def test_client_reconnects_to_an_engine_restarted_under_its_name(model_path, runtime_dir, reference):
    """`reconnect=True` follows the name; a notebook's session uses exactly that client (one
    mechanism) and tells its views when the engine behind it changed."""
    from workbench.jupyter.session import EngineSession

    first = start_engine(str(model_path), name="phoenix", **ENGINE_KW)
    follower = EngineClient.connect("phoenix", reconnect=True)
    plain = EngineClient.connect("phoenix")
    session = EngineSession("phoenix")
    seen = []
    session.on_change(seen.append)
    try:
        attached = session.client()
        assert attached.reconnect and seen == [attached]
        old_pid = follower.pid
        stop_engine(first)
        wait_for(lambda: not plain.alive, 10, "the clients to notice the engine is gone")
        assert not follower.alive  # no engine holds the name yet
        with pytest.raises(EngineDeadError):
            follower.status()
        second = start_engine(str(model_path), name="phoenix", **ENGINE_KW)
        try:
            assert follower.alive and follower.pid == second.pid != old_pid
            assert session.client() is attached and attached.pid == second.pid  # the same client, revived
            assert seen == [attached, attached]  # ...and the views were told to re-subscribe
            out = follower.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY, timeout=60)
            assert [o.token_ids for o in out] == reference(PROMPTS[:2])
            with follower.events("metrics") as sub:  # subscriptions work on the new engine too
                assert sub.get(timeout=10).kind == "metrics"
            assert not plain.alive  # without reconnect=True a client stays with its engine
            with pytest.raises(EngineDeadError):
                plain.status()
        finally:
            stop_engine(second)
    finally:
        follower.close()
        plain.close()
        attached.close()


def test_admission_bounds_the_text_waiting_for_the_tokenizer(tmp_path, runtime_dir):
    """Two big prompts back to back: the second arrives while the first is being tokenized and
    would take the waiting text past --max-queued-chars, so it is refused (EngineBusyError)."""
    from http_helpers import make_tiny_tokenized_model

    model = make_tiny_tokenized_model(tmp_path / "m")
    eng = start_engine(
        str(model), name="admit-chars", dtype="float32", num_kv_blocks=64, timeout=120, max_queued_chars=200_000
    )
    ctx = zmq.Context()
    try:
        info = conn.read_connection_file(runtime_dir / "admit-chars.json")
        s = _raw_dealer(ctx, info.request_address, b"bigsender")
        # 156,000 characters, under the length bound, and a prefix of it fits: only tokenizing it
        # whole finds its 13,000 tokens (tens of ms: the second prompt arrives meanwhile)
        text = " information" * 13_000
        for rid in ("big1", "big2"):
            s.send_multipart(
                [HEADER, encode(Submit([NewRequest(rid, prompt=text, params=SamplingParams(max_tokens=1))]))]
            )
        answers = {}
        for _ in range(2):
            m = _recv(s, 30_000)
            assert isinstance(m, Rejected), m
            answers[m.request_ids[0]] = m.error
        assert answers["big1"].type == "ValueError" and "prompt has 13000 tokens" in answers["big1"].message
        assert answers["big2"].type == "EngineBusyError"
        assert (
            "156,000 characters wait to be tokenized and this request adds 156,000 (limit 200,000)"
            in answers["big2"].message
        )
        out = eng.generate(prompt_token_ids=[[1, 2, 3]], params=GREEDY, timeout=60)  # and then it serves on
        assert out[0].finish_reason == "length"
    finally:
        ctx.destroy(linger=0)
        stop_engine(eng)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checksum_and_timeline_answers_are_built_while_steps_go_on():
    """Issue 32.7: weights_checksum() hashed 270 MB and timeline() encoded the whole timeline on the
    step loop, stalling every stream ~0.4 s. The loop now hands both to a worker thread: steps run
    while the answer is built (blake2b drops the GIL; the timeline is encoded a piece at a time)."""
    from workbench.ipc.protocol import encode_raw, encode_raw_in_pieces
    from workbench.timeline import Timeline

    eng = start_engine(name=f"background-calls-{os.getpid()}", max_num_seqs=4, timeout=240)  # the embedded model
    try:
        chunks = []
        params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
        runner = threading.Thread(target=lambda: chunks.extend(eng.stream(prompt_token_ids=[1, 2, 3], params=params)))
        runner.start()
        while len(chunks) < 20:
            time.sleep(0.01)
        start = time.monotonic()
        checksum = eng.weights_checksum()
        end = time.monotonic()
        assert checksum == eng.status()["weights_checksum"]
        timeline = eng.timeline()
        during = [s for s in timeline.steps if start < s.start and s.end < end]
        assert during, "no step ran while the weights were hashed"
        assert all("send" in s.parts for s in timeline.steps)  # an engine process times handing chunks out
        runner.join(120)
        assert chunks[-1].finish_reason == "length"
        # the piecewise encoding is the plain one, byte for byte
        full = eng.timeline()
        for t in (
            full,
            Timeline(steps=[], requests=[], cursor=0),
            Timeline(steps=full.steps[:15], requests=full.requests[:16], cursor=3, changes=full.changes),
        ):
            assert bytes(encode_raw_in_pieces(t)) == bytes(encode_raw(t))
    finally:
        eng.shutdown()


def test_workbench_ps_lists_running_engines_and_a_restart_keeps_the_last_log(model_path, runtime_dir):
    """`workbench ps` lists the engines of the runtime directory (name, pid, model); an engine
    started again under its name keeps the previous engine's log as NAME.log.1."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    eng = start_engine(str(model_path), name="ps-one", dtype="float32", num_kv_blocks=32)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "workbench.cli", "ps", "--json"], capture_output=True, text=True, env=env, timeout=60
        )
        assert out.returncode == 0, out.stderr
        rows = {r["name"]: r for r in json.loads(out.stdout)}
        assert rows["ps-one"]["pid"] == eng.pid and rows["ps-one"]["kind"] == "engine"
        assert rows["ps-one"]["uptime_s"] is not None and rows["ps-one"]["uptime_s"] >= 0
        text = subprocess.run(
            [sys.executable, "-m", "workbench.cli", "ps"], capture_output=True, text=True, env=env, timeout=60
        ).stdout
        assert "ps-one" in text and str(eng.pid) in text
        first_log = (runtime_dir / "ps-one.log").read_text()
        assert first_log
    finally:
        stop_engine(eng)
    again = start_engine(str(model_path), name="ps-one", dtype="float32", num_kv_blocks=32)
    try:
        assert (runtime_dir / "ps-one.log.1").read_text().startswith(first_log)  # and how it stopped
    finally:
        stop_engine(again)
    gone = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "ps", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert "ps-one" not in {r["name"] for r in json.loads(gone.stdout)}


def test_a_flood_of_refused_calls_is_a_few_log_lines(caplog):
    """Every refused configure was logged at INFO with its full arguments (22.6 MB of log after a
    fuzzing run): now at most `burst` lines a period, each cut short, the rest counted."""
    import logging

    from workbench.ipc.logs import QuietLog, short

    logger = logging.getLogger("workbench.test.quiet")
    quiet = QuietLog(logger, burst=3, period_s=60.0)
    with caplog.at_level(logging.INFO, logger="workbench.test.quiet"):
        shown = [quiet.note(f"configure {short({'x': 'y' * 5000})} rejected", now=i / 10) for i in range(100)]
        assert shown.count(True) == 3 and quiet.suppressed == 97
        assert quiet.note("after the period", now=70.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(len(line) < 400 for line in lines)
    assert lines[-1] == "after the period (97 similar line(s) suppressed)"


def test_an_engines_log_rotates_past_its_size_limit(tmp_path):
    """An engine's log (its stdout and stderr) moves to NAME.log.1 past the limit and the process
    writes on into a fresh NAME.log (22.6 MB of log after a fuzzing run, never rotated)."""
    log = tmp_path / "engine.log"
    with open(log, "wb") as f:
        done = subprocess.run(
            [sys.executable, str(REPO / "tests" / "rotate_child.py"), str(log), "1000"],
            stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60,
        )  # fmt: skip
    assert done.returncode == 0
    old, new = (tmp_path / "engine.log.1").read_text(), log.read_text()
    assert "x" * 1000 in old and "after the rotation" not in old
    assert new.startswith("first rotation: True") and "after the rotation" in new and "small again: False" in new
