"""The response cache (setting `response_cache`): an exact repeat of a greedy or seeded request is
answered from its earlier answer without a step; never a sampled request without a seed; emptied
when the numbers could change (a re-layout) or when it is turned off."""

from __future__ import annotations

import pytest

from workbench import LLM, SamplingParams
from workbench.engine.response_cache import ResponseCache
from workbench.outputs import RequestMetrics, RequestOutput

PROMPT = [5, 17, 33, 8, 91, 4, 60]


def _steps(llm) -> int:
    return len(llm.timeline().steps)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=48, response_cache=True)


def test_a_greedy_repeat_is_answered_without_a_step(llm):
    llm.configure(response_cache=True)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    [first] = llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    steps = _steps(llm)
    [again] = llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    assert _steps(llm) == steps  # no step ran
    assert again.from_cache and not first.from_cache
    assert again.token_ids == first.token_ids and again.text == first.text and again.request_id != first.request_id
    assert again.metrics.prefix_hit_tokens == len(PROMPT)
    assert llm.metrics()["total_response_cache_hits"] >= 1
    # other parameters are another request
    [longer] = llm.generate(prompt_token_ids=[PROMPT], params=SamplingParams(max_tokens=9, temperature=0))
    assert not longer.from_cache and _steps(llm) > steps
    # streamed, the cached answer comes as one chunk with the whole text
    chunks = list(llm.stream(prompt_token_ids=PROMPT, params=greedy))
    assert len(chunks) == 1 and chunks[0].token_ids_delta == first.token_ids and chunks[0].output.from_cache


def test_sampled_requests_repeat_only_when_seeded(llm):
    llm.configure(response_cache=True)
    unseeded = SamplingParams(max_tokens=8, temperature=1.0)
    outs = [llm.generate(prompt_token_ids=[PROMPT], params=unseeded)[0] for _ in range(3)]
    assert not any(o.from_cache for o in outs)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    [a] = llm.generate(prompt_token_ids=[PROMPT], params=seeded)
    [b] = llm.generate(prompt_token_ids=[PROMPT], params=seeded)
    assert not a.from_cache and b.from_cache and b.token_ids == a.token_ids


def test_a_relayout_or_turning_it_off_empties_it(llm):
    llm.configure(response_cache=True)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    assert llm.metrics()["response_cache_entries"] >= 1
    llm.configure(quantization="int8")  # other weights: other answers
    assert llm.metrics()["response_cache_entries"] == 0
    [q] = llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    assert not q.from_cache
    llm.configure(quantization="none")
    assert llm.metrics()["response_cache_entries"] == 0
    llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    llm.configure(response_cache=False)
    assert llm.metrics()["response_cache_entries"] == 0
    [off] = llm.generate(prompt_token_ids=[PROMPT], params=greedy)
    assert not off.from_cache


def test_the_cache_is_bounded_in_entries_and_age():
    cache = ResponseCache(max_entries=2, ttl_s=10.0)
    out = RequestOutput("r", [1], [2], "x", "stop", RequestMetrics())
    greedy = SamplingParams(temperature=0)
    keys = [ResponseCache.key([i], greedy, 0) for i in range(3)]
    for i, k in enumerate(keys):
        cache.put(k, out, now=float(i))
    assert len(cache) == 2 and cache.get(keys[0], now=3.0) is None  # the oldest went first
    assert cache.get(keys[2], now=5.0) is out
    assert cache.get(keys[2], now=20.1) is None  # past its TTL
    assert ResponseCache.key([1], SamplingParams(temperature=0.7), 0) is None  # sampled, unseeded: never
    cache.put(keys[1], RequestOutput("r", [1], [2], "x", "abort", RequestMetrics()))
    assert cache.get(keys[1], now=1.0) is out  # an aborted answer does not replace the good one
