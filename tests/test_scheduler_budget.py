"""The step budget counts long-context attention (setting `attention_aware_budget`): past the
model's attention context a prefill chunk's tokens cost more, so long prompts take smaller chunks
and a step beside running decodes stays about as long as an early one (a tester saw a 7,000-token
prompt hold every other stream for 1.9-11.9 s: each 1,023-token chunk at a longer context took
longer). Outputs do not change: only where the chunks end."""

from __future__ import annotations

import random

import pytest

from workbench import LLM, SamplingParams
from workbench.engine.scheduler import (
    CHUNK_ALIGN,
    attention_context_of,
    chunk_cost,
    chunk_in_time,
    chunk_within,
    time_units,
)


def _brute(context: int, n: int, c0: float) -> float:
    return sum(1 + max(0, context + i - int(c0)) / c0 for i in range(n))


def test_chunk_cost_is_one_a_token_until_the_attention_context_then_grows():
    rng = random.Random(0)
    for _ in range(300):
        c0 = rng.choice([16.0, 100.0, 1389.7])
        context, n = rng.randrange(0, 5000), rng.randrange(1, 2000)
        assert chunk_cost(context, n, c0) == pytest.approx(_brute(context, n, c0))
    assert chunk_cost(0, 1000, 1389.7) == 1000  # short contexts: the token budget as before
    assert chunk_cost(0, 1000, None) == 1000
    for context in (0, 500, 3000, 7000):
        n = chunk_within(context, 8000, 1024, 1389.7)  # the most whole tiles within the budget
        assert n % CHUNK_ALIGN == 0 and chunk_cost(context, n, 1389.7) <= 1024 < chunk_cost(context, n + 16, 1389.7)
    assert chunk_within(7000, 5, 0.5, 100.0) == 1  # always progress
    assert chunk_within(7000, 20, 1024, 1389.7) == 20  # a prompt's last chunk is not cut to a tile
    assert chunk_within(0, 8000, 1016, None) == 1016  # counting tokens only: the budget as it is


def test_the_embedded_models_attention_context():
    from workbench.sim.workloads import model_config

    c0 = attention_context_of(model_config(None))  # SmolLM2-135M: 30 layers of 9 x 64 query dims
    assert 1000 < c0 < 2000, c0
    sizes, context = [], 0
    while context < 8000:
        sizes.append(chunk_within(context, 8000 - context, 1024, c0))
        context += sizes[-1]
    assert sizes[0] == 1024 and sizes[-2] < 256 and sizes == sorted(sizes[:-1], reverse=True) + sizes[-1:]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return str(tiny_llama[0])


def _run(path: str, aware: bool):
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, attention_aware_budget=aware)
    llm.engine.scheduler.attention_context = 32.0  # the tiny model's own is tiny too: make it visible
    rng = random.Random(3)
    long = [rng.randrange(3, 256) for _ in range(400)]
    short = [[rng.randrange(3, 256) for _ in range(5)] for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[short[0], long, short[1]], params=params)
    chunks = [
        next(b.num_tokens for b in s.batch if b.request_id == outs[1].request_id)
        for s in llm.timeline().steps
        if any(b.request_id == outs[1].request_id and b.kind == "prefill" for b in s.batch)
    ]
    return outs, chunks


def test_long_prompts_take_smaller_chunks_and_answer_the_same(tiny):
    aware, chunks = _run(tiny, True)
    plain, plain_chunks = _run(tiny, False)
    assert [o.token_ids for o in aware] == [o.token_ids for o in plain]  # only the chunk ends moved
    assert len(set(plain_chunks[1:-1])) == 1 and plain_chunks[1] >= 60  # the budget less the decodes beside
    assert chunks[-2] < chunks[1] and max(chunks[2:-1]) < 64, chunks
    assert 399 <= sum(chunks) <= 400  # (a last single token runs as a decode)


def test_while_requests_decode_the_step_keeps_its_time_target(tiny):
    """step_time_target_ms caps a step's prefill work while other requests decode, at the time per
    unit of work recent steps took: with a target far below what a full chunk takes, the long
    prompt goes in small chunks once the short requests decode; with 0, in full ones."""
    from workbench.engine.scheduler import MIN_CAPPED_BUDGET

    def chunks(target: int):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=96, max_num_batched_tokens=256, step_time_target_ms=target)
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (4, 440, 4)]
        outs = llm.generate(
            prompt_token_ids=prompts, params=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        )
        rid = outs[1].request_id
        steps = [s for s in llm.timeline().steps if any(b.request_id == rid and b.kind == "prefill" for b in s.batch)]
        sizes = [next(b.num_tokens for b in s.batch if b.request_id == rid) for s in steps]
        bounds = [(s.target_ms, s.predicted_ms) for s in steps]
        return sizes, [o.token_ids for o in outs], llm.engine.scheduler.ms_per_unit, bounds

    capped, capped_tokens, rate, bounds = chunks(1)
    free, free_tokens, _, free_bounds = chunks(0)
    assert rate is not None and rate > 0
    assert max(capped[1:]) <= MIN_CAPPED_BUDGET < max(free[1:-1]), (capped, free)
    assert capped_tokens == free_tokens  # only where the chunks end moved
    # the timeline says which steps the target cut, and the time predicted for what was left
    assert bounds[0] == (0.0, 0.0) and all(t == 1.0 and p > 0 for t, p in bounds[1:-1]), bounds
    assert set(free_bounds) == {(0.0, 0.0)}


def test_a_step_past_its_time_target_admits_no_empty_chunks(tiny):
    """With the target spent by the step's first prefill, the other prompts wait for later steps:
    no request is ever scheduled for zero tokens, and every answer is the one without a target."""

    def run(target: int):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=512, step_time_target_ms=target)
        rng = random.Random(9)
        prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (4, 300, 40, 200, 40, 6)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        first = llm.generate(prompt_token_ids=prompts[:1], params=params)  # a decode, so the target applies
        outs = llm.generate(prompt_token_ids=prompts[1:], params=params)
        entries = [b for s in llm.timeline().steps for b in s.batch]
        return [o.token_ids for o in first + outs], entries, llm.timeline().steps

    capped, entries, steps = run(1)
    free, _, _ = run(0)
    assert all(b.num_tokens >= 1 for b in entries), [b for b in entries if b.num_tokens < 1]
    assert any(s.target_ms for s in steps)  # the target did cut steps
    assert capped == free


def test_step_time_is_predicted_linear_in_context():
    """A token counts one time unit plus its context over the time context; the capped chunk is
    the most whole tiles whose units fit what the target leaves."""
    assert time_units(0, 10, None) == 10
    assert time_units(100, 4, 50.0) == pytest.approx(sum(1 + (100 + i) / 50 for i in range(4)))
    for context, left in ((0, 300.0), (4000, 300.0), (7000, 900.0)):
        n = chunk_in_time(context, 8000, left, 2560.0)
        assert n % CHUNK_ALIGN == 0 and time_units(context, n, 2560.0) <= left < time_units(context, n + 16, 2560.0)
    assert chunk_in_time(7000, 10, 1e9, 2560.0) == 10  # it all fits: the whole rest
    assert chunk_in_time(7000, 100, 0.5, 2560.0) == 0  # nothing fits (the step's first prefill gets a floor)
