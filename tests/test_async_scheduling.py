"""Async scheduling (`async_scheduling`, engine/inflight.py): a step is launched before the last
one's tokens are read, and every output is what the synchronous engine gives, token for token
(float32, greedy and seeded sampling), through stops, aborts, preemptions, prefix hits, chunked
prefills, requests that need their tokens on the host, and the setting switched mid-run. On a CPU
the device is the host, so nothing overlaps in time here; what is checked is the bookkeeping that
lets a GPU overlap (placeholders, the device-side inputs, the late landing)."""

from __future__ import annotations

import random

import pytest

from workbench import LLM, SamplingParams
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.sequence import PLACEHOLDER
from workbench.timeline import step_breakdown


def _prompts(n=14, seed=5):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(24)]  # a prefix of 1.5 blocks some prompts share
    out = []
    for i in range(n):
        own = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 60))]
        out.append(shared + own if i % 3 == 0 else own)
    return out


def _params(n=14, seed=5):
    """Greedy and seeded sampling (top-p, top-k, min-p), stop tokens that end some requests early;
    every fifth needs its tokens on the host (logprobs, penalties, min_tokens): its steps run
    synchronously among the overlapped ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kw = dict(max_tokens=rng.randrange(1, 40), seed=i, stop_token_ids=[rng.randrange(3, 256) for _ in range(8)])
        kw.update([{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 0.8, "top_k": 20},
                   {"temperature": 1.0, "min_p": 0.05}][i % 4])  # fmt: skip
        if i % 5 == 4:
            kw.update([{"logprobs": 2}, {"repetition_penalty": 1.3}, {"min_tokens": 3}][i // 5 % 3])
        out.append(SamplingParams(**kw))
    return out


def _run(path, prompts, params, **settings):
    llm = LLM(str(path), dtype="float32", **settings)
    outs = llm.generate(prompt_token_ids=prompts, params=params)
    # logprobs to 1e-5: a batch of another shape rounds its float32 sums differently (~5e-7 seen)
    got = [(o.token_ids, o.finish_reason, [(x.token_id, round(x.logprob, 5)) for x in o.logprobs or []]) for o in outs]
    eng = llm.engine
    assert eng._inflight is None and not eng.requests
    eng.scheduler.block_manager.check_idle()
    steps = eng.timeline.steps
    assert [s.start for s in steps] == sorted(s.start for s in steps)  # recorded in launch order
    assert 0 <= step_breakdown(steps)["between_steps_share"] < 1  # overlapping steps leave no negative gap
    return got, dict(eng.totals), len(steps)


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_kv_blocks=128, max_num_seqs=6),
        dict(num_kv_blocks=14, max_num_batched_tokens=32),  # preemptions, chunked prefills
        dict(num_kv_blocks=128, batching="static", max_num_seqs=4),
    ],
    ids=["continuous", "preempting-chunked", "static"],
)
def test_outputs_equal_the_synchronous_engines(tiny_qwen2, settings):
    path, _ = tiny_qwen2
    prompts, params = _prompts(), _params()
    sync, sync_totals, _ = _run(path, prompts, params, **settings)
    got, totals, steps = _run(path, prompts, params, async_scheduling=True, **settings)
    assert got == sync
    assert {r for _, r, _ in sync} == {"stop", "length"}  # the stops' wasted rows were exercised
    assert sync_totals["overlapped_steps"] == 0 and 0 < totals["overlapped_steps"] < steps
    assert totals["output_tokens"] == sync_totals["output_tokens"] == sum(len(t) for t, _, _ in got)
    if "max_num_batched_tokens" in settings:
        assert totals["preemptions"] > 0
    else:
        assert totals["prefix_hit_tokens"] > 0  # blocks registered as tokens landed, placeholders never


def test_abort_and_stop_while_a_step_is_in_flight(tiny_llama):
    """An abort and a stop string's Stop reach requests whose next token is still on the device:
    their outputs hold no placeholder and are what the synchronous engine gave up to there; the
    others run on unchanged and every block comes back."""
    path, _ = tiny_llama
    prompts = _prompts(4, seed=9)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sync, _, _ = _run(path, prompts, [greedy] * 4, num_kv_blocks=64)
    eng = LLMEngine(str(path), dtype="float32", num_kv_blocks=64, async_scheduling=True)
    rids = [eng.add_request(prompt_token_ids=p, params=greedy) for p in prompts]
    done = {}
    while not (eng._inflight and all(len(done.get(r, ())) >= 3 and eng.requests[r].seq.pending for r in rids)):
        for c in eng.step():
            done.setdefault(c.request_id, []).extend(c.token_ids_delta)
    seq = eng.requests[rids[0]].seq
    assert seq.token_ids[-1] == PLACEHOLDER and eng.totals["overlapped_steps"] > 0
    aborted = eng.abort_request(rids[0])
    known = len(done.get(rids[0], []))
    assert aborted.finish_reason == "abort" and aborted.output.token_ids == sync[0][0][:known]
    out = eng.core_stop(rids[1], keep=2)  # an output processor found a stop string in its first two tokens
    assert out.finish_reason == "stop" and out.final.token_ids == sync[1][0][:2]
    while eng.has_unfinished_requests():
        for c in eng.step():
            assert c.request_id not in rids[:2]
            done.setdefault(c.request_id, []).extend(c.token_ids_delta)
    assert [done[r] for r in rids[2:]] == [t for t, _, _ in sync[2:]]
    eng.scheduler.block_manager.check_idle()


def test_switched_live_mid_run(tiny_llama):
    """Switched on and off between steps, and speculation (which reads tokens on the host) turned on
    while a step is in flight: the step lands first, and the outputs are the synchronous ones."""
    path, _ = tiny_llama
    prompts = _prompts(6, seed=11)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sync, _, _ = _run(path, prompts, [greedy] * 6, num_kv_blocks=96)
    eng = LLMEngine(str(path), dtype="float32", num_kv_blocks=96)
    rids = [eng.add_request(prompt_token_ids=p, params=greedy) for p in prompts]
    changes = {3: {"async_scheduling": True}, 8: {"speculative": "ngram"}, 12: {"speculative": "off"},
               16: {"async_scheduling": False}, 19: {"async_scheduling": True}}  # fmt: skip
    done, step = {}, 0
    while eng.has_unfinished_requests():
        if step in changes:
            eng.configure(**changes[step])
        for c in eng.step():
            done.setdefault(c.request_id, []).extend(c.token_ids_delta)
        step += 1
    assert [done[r] for r in rids] == [t for t, _, _ in sync]
    assert eng.totals["overlapped_steps"] > 0 and eng.totals["spec_verifies"] > 0
    eng.scheduler.block_manager.check_idle()
