"""The one engine interface (`workbench.Engine`): every implementation declares it, `connect`
picks one, the in-process `LLM` serves interleaved and asyncio callers, and the workload driver
measures through nothing else."""

from __future__ import annotations

import asyncio

import pytest

import workbench
from workbench import LLM, SamplingParams
from workbench.bench.driver import run_workload, serve_workload
from workbench.bench.workload import make_workload
from workbench.interface import Engine
from workbench.ipc.client import EngineClient
from workbench.remote import RemoteEngineClient

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 17, 21], [30, 31, 32], [7, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=64)


def test_every_implementation_declares_the_interface(llm):
    for cls in (LLM, EngineClient, RemoteEngineClient):
        assert issubclass(cls, Engine) and not cls.__abstractmethods__, cls
    assert workbench.connect(llm) is llm  # an Engine already: as is
    assert workbench.Engine is Engine


def test_connect_names_what_it_could_not_find(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nobody-here"):
        workbench.connect("nobody-here")


def test_interleaved_streams_both_progress_token_for_token(llm):
    """Two streams iterated in turn: each caller's steps also advance the other's request, and
    every chunk reaches its own caller (none is lost to the other stream)."""
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:2], params=GREEDY)]
    a = llm.stream(prompt_token_ids=PROMPTS[0], params=GREEDY)
    b = llm.stream(prompt_token_ids=PROMPTS[1], params=GREEDY)
    got: dict[str, list[int]] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name, it in list(live.items()):
            chunk = next(it, None)
            if chunk is None or chunk.finish_reason is not None:
                if chunk is not None:
                    got[name] += chunk.token_ids_delta
                live.pop(name)
            else:
                got[name] += chunk.token_ids_delta
    assert [got["a"], got["b"]] == expected
    assert not llm.engine.has_unfinished_requests()


def test_asyncio_twins_equal_generate(llm):
    expected = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)]

    async def main():
        outs = await llm.agenerate(prompt_token_ids=PROMPTS, params=GREEDY)
        streamed = [c async for c in llm.astream(prompt_token_ids=PROMPTS[2], params=GREEDY)]
        return outs, streamed

    outs, streamed = asyncio.run(main())
    assert [o.token_ids for o in outs] == expected
    assert [t for c in streamed for t in c.token_ids_delta] == expected[2]


def test_asyncio_control_calls_answer_as_their_blocking_twins(llm):
    """The control calls the HTTP front and the Jupyter server make are declared on `Engine`
    (no string RPCs): each asyncio twin answers what its blocking call does, and a rejected
    change raises the same error and changes nothing."""
    from workbench.cluster.engine import ClusterEngine

    assert not ClusterEngine.__abstractmethods__
    for cls in (LLM, EngineClient, RemoteEngineClient, ClusterEngine):
        assert not hasattr(cls, "acall") or cls is EngineClient, cls  # only the process client has a wire

    async def both():
        status, settings, metrics, schema, timeline = await asyncio.gather(
            llm.astatus(), llm.asettings(), llm.ametrics(), llm.aschema(), llm.atimeline(None)
        )
        changed = await llm.aconfigure(max_num_seqs=8)
        with pytest.raises(ValueError, match="max_num_seqs"):
            await llm.aconfigure(max_num_seqs=-1)
        return status, settings, metrics, schema, timeline, changed

    before = llm.settings()
    status, settings, metrics, schema, timeline, changed = asyncio.run(both())
    try:
        assert status["model"] == llm.status()["model"] and settings == before
        assert set(metrics) == set(llm.metrics()) and schema == llm.schema()
        assert timeline.cursor <= llm.timeline().cursor
        assert changed["max_num_seqs"] == 8 and llm.settings()["max_num_seqs"] == 8
        assert llm.weights_checksum() == llm.engine.weights_checksum()
    finally:
        llm.configure(max_num_seqs=before["max_num_seqs"])


def test_in_process_events_and_abort(llm):
    with llm.events(("timeline", "settings")) as sub:
        llm.generate(prompt_token_ids=PROMPTS[:1], params=GREEDY)
        ev = sub.get(timeout=5)
        assert ev.kind == "timeline" and ev.data.steps
        before = llm.settings()["max_num_seqs"]
        llm.configure(max_num_seqs=before + 1)
        ev = sub.get(timeout=5)
        while ev.kind != "settings":  # the generate's step increments come first
            assert ev.kind == "timeline"
            ev = sub.get(timeout=5)
        assert ev.data["changes"] == {"max_num_seqs": before + 1}
        llm.configure(max_num_seqs=before)
    stream = llm.stream(prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=50, temperature=0.0))
    first = next(stream)
    llm.abort(first.request_id)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert not llm.engine.has_unfinished_requests()


def test_driver_releases_on_schedule_and_caps_concurrency(llm):
    w = make_workload(6, seed=1, vocab_size=256, prompt_len=(4, 8), output_len=(3, 5), arrival="all")
    cursor = llm.timeline(since=1 << 62).cursor
    served, start = serve_workload(llm, w.requests, max_concurrency=2)
    assert [s.request.index for s in served] == list(range(6))
    assert all(len(s.output.token_ids) == s.request.max_tokens for s in served)
    steps = llm.timeline(since=cursor).steps
    assert steps and max(len(s.batch) for s in steps) <= 2  # never more than 2 in flight
    records, _ = run_workload(llm, w.requests)
    assert [r.token_ids for r in records] == [s.output.token_ids for s in served]  # same greedy tokens


def test_driver_keeps_or_raises_a_failed_request(llm):
    from workbench.bench.workload import BenchRequest

    too_long = BenchRequest(0, list(range(3, 10_000)), 2)
    fine = BenchRequest(1, PROMPTS[0], 3)
    with pytest.raises(ValueError, match="context"):
        serve_workload(llm, [too_long, fine])
    served, _ = serve_workload(llm, [too_long, fine], keep_errors=True)  # the endpoint bench counts errors
    assert isinstance(served[0].error, ValueError) and served[0].output is None
    assert served[0].record().token_ids == [] and len(served[1].output.token_ids) == 3
    assert not llm.engine.has_unfinished_requests()
