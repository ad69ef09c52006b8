"""Issue 32.1: the prefix cache never serves KV computed under other weights, kernels or experts.

Every setting that shapes KV values (tagged `shapes_kv`) is flipped and back under a warm prefix
cache; each greedy output must equal a cold run (fresh cache) under the same settings. Blocks
cached before a flip are found again when the settings come back.
"""

import random

import pytest
from conftest import make_tiny_model

from workbench import LLM, SamplingParams
from workbench.engine.block_manager import BlockManager
from workbench.engine.sequence import Sequence
from workbench.settings import RELAYOUT, kv_shaping_settings, setting_kind, setting_names

GREEDY = SamplingParams(max_tokens=20, temperature=0)

# (the settings before the flip, the flip): every KV-shaping setting appears in a flip
FLIPS = [
    ({}, {"quantization": "int8"}),
    ({}, {"quantization": "int4"}),
    ({"quantization": "int4"}, {"quant_group_size": 32}),
    ({"quantization": "int4"}, {"quant_group_size": 64}),
    ({}, {"kv_cache_dtype": "int8"}),
    ({}, {"kv_cache_dtype": "fp8"}),
    ({}, {"cpu_kernels": False}),
    ({}, {"attention_backend": "torch"}),
    ({}, {"attention_backend": "triton"}),
    ({}, {"moe_top_k": 1}),
    ({"attention_backend": "triton"}, {"prefill_attention": "sdpa"}),
]


def test_every_kv_shaping_setting_has_a_flip_and_every_relayout_shapes_kv():
    flipped = {name for _, flip in FLIPS for name in flip}
    assert flipped == set(kv_shaping_settings())
    assert {n for n in setting_names() if setting_kind(n) == RELAYOUT} <= flipped


def _flips_for(llm, slow_triton: bool):
    moe = bool(llm.engine.model_config.num_experts)
    for base, flip in FLIPS:
        if "moe_top_k" in flip and not moe:
            continue
        if "triton" in (flip.get("attention_backend"), base.get("attention_backend")) and slow_triton:
            continue  # the Triton interpreter over 30 layers takes minutes; the tiny models cover it
        yield base, flip


def _check_round_trips(llm, prompt, slow_triton=False):
    def gen():
        out = llm.generate(prompt_token_ids=[prompt], params=GREEDY)[0]
        return out.token_ids, out.metrics.prefix_hit_tokens

    defaults = llm.settings()
    checked = 0
    for base, flip in _flips_for(llm, slow_triton):
        llm.configure(**{**{k: defaults[k] for k in flip}, **base})
        llm.reset_prefix_cache()
        cold_base, _ = gen()
        assert gen() == (cold_base, (len(prompt) - 1) // 16 * 16), "the warm run hits the cached prompt"
        llm.configure(**flip)
        warm_flipped, hits = gen()  # the base settings' blocks are cached: none may be used
        assert hits == 0, f"{flip}: a block computed under {base or 'the defaults'} was reused"
        llm.reset_prefix_cache()
        cold_flipped, _ = gen()
        assert warm_flipped == cold_flipped, f"{flip} after a warm cache under {base or 'the defaults'}"
        llm.configure(**{k: defaults[k] if k not in base else base[k] for k in flip})
        back, hits = gen()  # only the flip's blocks are cached now: none may be used
        assert hits == 0 and back == cold_base, f"back from {flip}"
        assert gen() == (cold_base, (len(prompt) - 1) // 16 * 16)
        checked += 1
        llm.configure(**{k: defaults[k] for k in base})
    return checked


def test_round_trips_on_smollm2_bf16():
    """The tester's repro: the real model in bf16, on the engine's C kernels."""
    llm = LLM(num_kv_blocks=64)
    prompt = llm.tokenizer.encode("Albert Einstein, the physicist who changed how we think about time, was born in")
    assert len(prompt) >= 17
    assert _check_round_trips(llm, prompt, slow_triton=True) == 8


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_round_trips_on_tiny_float32_models(tmp_path, arch):
    make_tiny_model(tmp_path, arch, seed=21)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(37)]
    assert _check_round_trips(llm, prompt) == (11 if arch == "mixtral" else 10)


def test_cached_blocks_come_back_with_their_settings(tiny_llama):
    """A round trip keeps what the prefix cache held: blocks are keyed by the settings, not dropped."""
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompt = list(range(3, 40))
    llm.generate(prompt_token_ids=[prompt], params=GREEDY)
    llm.configure(quantization="int8")
    llm.generate(prompt_token_ids=[prompt], params=GREEDY)
    llm.configure(quantization="none")
    out = llm.generate(prompt_token_ids=[prompt], params=GREEDY)[0]
    assert out.metrics.prefix_hit_tokens == 32


def _seq(rid, tokens):
    return Sequence(rid, tokens, SamplingParams(max_tokens=64), 0.0)


def _run(bm, seq, upto):
    """The scheduler's bookkeeping for a sequence computed up to `upto` tokens."""
    assert bm.ensure_capacity(seq, upto)
    seq.num_computed_tokens = upto
    bm.register_computed(seq)


@pytest.mark.parametrize("change", ["salt", "reset"])
def test_a_sequence_spanning_a_change_publishes_no_more_blocks(change):
    """Its later blocks mix KV computed before and after the change: publishing them would hand a
    new request KV that no cold run computes. (After a reset, the old code also chained its next
    block from nothing, so a new prompt equal to that block's tokens matched KV of other positions.)"""
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 124))
    running = _seq("a", tokens)
    bm.allocate(running, 4)
    _run(bm, running, 8)
    assert len(bm.hash_to_block) == 2
    if change == "salt":
        bm.set_salt(7)
        bm.set_salt(0)  # back to the same settings: its KV still mixes both
    else:
        bm.reset_prefix_cache()
    cached = len(bm.hash_to_block)
    _run(bm, running, 24)
    assert len(bm.hash_to_block) == cached, "blocks computed across the change were published"
    echo = _seq("b", tokens[8:12] + [1, 2])  # its first block's tokens equal the running one's third
    assert bm.match_prefix(echo) == []
    fresh = _seq("c", tokens)
    assert len(bm.match_prefix(fresh)) == (2 if change == "salt" else 0)
    bm.free(running)
    bm.check_idle()
