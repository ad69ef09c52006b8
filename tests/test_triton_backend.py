"""The engine on our Triton kernels (interpreted on a CPU) gives the torch backend's tokens."""

import random

import pytest

from workbench import LLM, SamplingParams

pytest.importorskip("triton")


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 16, 17, 30)]


@pytest.mark.parametrize("settings", [dict(), dict(kv_cache_dtype="int8"), dict(max_num_batched_tokens=24)])
def test_triton_backend_matches_torch(tiny_qwen2, settings):
    path, _ = tiny_qwen2
    params = SamplingParams(max_tokens=6, temperature=0)
    common = dict(dtype="float32", num_kv_blocks=48, block_size=16, **settings)
    torch_out = LLM(str(path), attention_backend="torch", **common).generate(prompt_token_ids=_prompts(), params=params)
    llm = LLM(str(path), attention_backend="triton", **common)
    assert llm.status()["attention_backend"] == "triton"
    triton_out = llm.generate(prompt_token_ids=_prompts(), params=params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]


def test_backend_switch_live(tiny_qwen2):
    path, _ = tiny_qwen2
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = LLM(str(path), dtype="float32", num_kv_blocks=48).generate(prompt_token_ids=_prompts(), params=params)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=48)
    eng = llm.engine
    rids = [eng.add_request(prompt_token_ids=p, params=params) for p in _prompts()]
    done, i = {}, 0
    while eng.has_unfinished_requests():
        eng.configure(attention_backend=["triton", "torch"][i % 2])
        for c in eng.step():
            if c.output:
                done[c.request_id] = c.output.token_ids
        i += 1
    assert [done[r] for r in rids] == [o.token_ids for o in expected]
