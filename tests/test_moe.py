"""Mixture-of-experts models (Mixtral: top-2 of 4, renormalised; Qwen3-MoE: top-2 of 8, not
renormalised, with a dense layer and per-head q/k norm; OLMoE: many small experts, top-4 of 16,
q/k norm over all heads) against transformers on the same weights, the per-step expert counts,
and the live `moe_top_k` override."""

from __future__ import annotations

import pytest
from conftest import assert_greedy_case, hf_greedy, make_tiny_model
from test_engine import ragged_prompts

from workbench import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0)
CASES = {
    "continuous": {},
    "chunked-odd": {"max_num_batched_tokens": 19},
    "static": {"batching": "static", "max_num_seqs": 3},
    "preemption": {"num_kv_blocks": 9, "block_size": 8, "max_num_batched_tokens": 32},
    "ngram-speculation": {"speculative": "ngram", "num_speculative_tokens": 3},
    "draft-speculation": {"speculative": "draft", "num_speculative_tokens": 2},
    "off": {"batching": "off"},
    "async": {"async_scheduling": True, "max_num_batched_tokens": 24},
}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "olmoe"])
def moe_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = make_tiny_model(path, request.param, seed=11)
    prompts = ragged_prompts(seed=12, lengths=(3, 17, 33, 50))
    return request.param, path, prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("case", list(CASES))
def test_moe_greedy_matches_transformers(moe_model, case):
    arch, path, prompts, expected = moe_model
    assert_greedy_case(path, prompts, expected, GREEDY, CASES[case], preempts=case == "preemption")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_expert_counts_sum_to_tokens_times_top_k(moe_model, overlap):
    """Each step's counts are its own (with async scheduling too: read at its launch, not when it lands)."""
    arch, path, prompts, _ = moe_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24, async_scheduling=overlap)
    llm.generate(prompt_token_ids=prompts, params=GREEDY)
    cfg = llm.engine.model_config
    steps = llm.timeline().steps
    assert steps and all(len(s.expert_counts) == len(cfg.moe_layers) for s in steps)
    for s in steps:
        tokens = sum(e.num_tokens for e in s.batch)
        assert all(sum(layer) == tokens * cfg.num_experts_per_tok for layer in s.expert_counts), s
        assert all(len(layer) == cfg.num_experts for layer in s.expert_counts)
    assert llm.status()["kernel_variant"] == "torch"
    m = llm.metrics()  # the recent window's load, with the other metrics
    assert len(m["expert_load"]) == len(cfg.moe_layers) and m["moe_imbalance"] >= 1.0
    from workbench.timeline import imbalance

    assert m["moe_layer_imbalance"] == [imbalance(row) for row in m["expert_load"]]  # what the panel draws
    assert max(m["moe_layer_imbalance"]) == m["moe_imbalance"]
    assert sum(m["expert_load"][0]) == sum(sum(e.num_tokens for e in s.batch) for s in steps) * cfg.num_experts_per_tok


def test_moe_top_k_is_live_changes_outputs_and_is_validated(moe_model):
    arch, path, prompts, expected = moe_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    cfg = llm.engine.model_config
    default_scores = llm.score(prompts[3])
    llm.configure(moe_top_k=1)
    llm.generate(prompt_token_ids=prompts, params=GREEDY)
    assert all(
        sum(layer) == sum(e.num_tokens for e in s.batch) for s in llm.timeline().steps[-3:] for layer in s.expert_counts
    )
    assert llm.score(prompts[3]) != pytest.approx(default_scores)  # fewer experts per token: other outputs
    llm.configure(moe_top_k=None)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=GREEDY)] == expected
    with pytest.raises(ValueError, match=rf"moe_top_k.*allowed None or 1\.\.{cfg.num_experts}"):
        llm.configure(moe_top_k=cfg.num_experts + 1)
    with pytest.raises(ValueError, match="moe_top_k"):
        llm.configure(moe_top_k=0)


def test_moe_experts_run_on_the_c_gemvs_in_bf16(moe_model):
    """bf16 on a CPU with a kernel variant: each chosen expert's matmuls go through our GEMV kernel
    (every ISA variant), the routing stays in torch; greedy tokens equal the torch-only path's."""
    from workbench_kernels import cpu

    if not cpu.available():
        pytest.skip(f"no C kernel variant on this CPU: {cpu.unavailable_reason()}")
    arch, path, prompts, _ = moe_model
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=64)
    st = llm.status()
    assert st["cpu_kernels"] and st["kernel_variant"] == cpu.variant()
    assert "mixture-of-experts layers: each chosen expert runs on our GEMVs" in st["kernel_variant_reason"]
    experts = [lin for moe in llm.engine.runner.model.moe_layers for lin in moe.linears()]
    assert experts and all(lin.native and lin._native is not None for lin in experts)
    calls = {"n": 0}
    first = experts[0]._native
    real = first.__call__

    class Counting:
        def __call__(self, x):
            calls["n"] += 1
            return real(x)

    experts[0]._native = Counting()
    try:
        outs = llm.generate(prompt_token_ids=prompts, params=GREEDY)
    finally:
        experts[0]._native = first
    assert calls["n"] > 0  # that expert ran on the C GEMV
    torch_only = LLM(str(path), dtype="bfloat16", num_kv_blocks=64, cpu_kernels=False)
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in torch_only.generate(prompt_token_ids=prompts, params=GREEDY)
    ]


def test_moe_through_the_triton_fused_kernel(moe_model):
    """The triton backend runs MoE layers through the fused-MoE kernel (here in Triton's
    interpreter): the same greedy tokens as transformers, and the same expert counts."""
    arch, path, prompts, expected = moe_model
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, attention_backend="triton")
    model = llm.engine.runner.model
    assert model.moe_layers and all(m.fused for m in model.moe_layers)
    outs = llm.generate(prompt_token_ids=prompts[:2], params=GREEDY)
    assert [o.token_ids for o in outs] == expected[:2]
    cfg = llm.engine.model_config
    for step in llm.timeline().steps:
        tokens = sum(e.num_tokens for e in step.batch)
        assert all(sum(layer) == tokens * cfg.num_experts_per_tok for layer in step.expert_counts)
    llm.configure(attention_backend="torch")
    assert not any(m.fused for m in model.moe_layers)


def test_a_dense_model_refuses_moe_top_k(tiny_llama):
    llm = LLM(str(tiny_llama[0]), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="not a mixture-of-experts model; allowed: None"):
        llm.configure(moe_top_k=2)
    assert llm.settings()["moe_top_k"] is None


def test_the_dashboard_shows_live_expert_routing(tmp_path_factory):
    """An engine process serving a MoE model: the dashboard gets the per-step counts with the
    timeline events and draws the routing heatmap; the step tooltip column carries the routing."""
    from jupyter_helpers import private_runtime_dir, stop_engine, wait_for

    from workbench.ipc.launch import start_engine
    from workbench.jupyter.dashboard import Dashboard

    path = tmp_path_factory.mktemp("dash-mixtral")
    make_tiny_model(path, "mixtral", seed=11)
    with private_runtime_dir(tmp_path_factory.mktemp("rt-moe")):
        eng = start_engine(str(path), name="moe", dtype="float32", num_kv_blocks=64, timeout=120)
        try:
            dash = Dashboard(client=eng, start=False, history_s=None)
            eng.generate(prompt_token_ids=ragged_prompts(seed=1, lengths=(12, 20)), params=GREEDY)
            wait_for(lambda: (dash.pump(), dash.heatmap is not None)[1], 20, "the routing heatmap")
            cols = dash.heatmap.source.data
            assert set(cols["layer"]) == {0, 1} and len(cols["expert"]) == 8 and sum(cols["tokens"]) > 0
            assert "worst imbalance" in dash.heatmap.figure.title.text
            assert dash.heatmap.widget() in dash.widget.children
            dash.close()
        finally:
            stop_engine(eng)


def test_moe_with_shared_prefixes_from_the_cache(moe_model):
    """Prompts that share their first blocks: the second call reuses the cached KV and still
    matches transformers token for token."""
    arch, path, _, _ = moe_model
    import transformers

    model = (
        {
            "mixtral": transformers.MixtralForCausalLM,
            "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "olmoe": transformers.OlmoeForCausalLM,
        }[arch]
        .from_pretrained(path)
        .eval()
    )
    base = ragged_prompts(seed=21, lengths=(40,))[0]
    prompts = [base + [5, 6], base + [9, 10, 11], base[:34]]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8)
    first = llm.generate(prompt_token_ids=prompts[:1], params=GREEDY)
    rest = llm.generate(prompt_token_ids=prompts[1:], params=GREEDY)
    assert [o.token_ids for o in first + rest] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    assert llm.metrics()["total_prefix_hit_tokens"] > 0


def test_moe_from_a_gguf_file(moe_model, tmp_path):
    """llama.cpp's layout: Mixtral filed as a llama-arch GGUF (expert_count, q/k rows permuted),
    Qwen3-MoE and OLMoE as their own; each MoE layer's experts stacked in one tensor per
    projection (ffn_{gate,up,down}_exps) beside the router (ffn_gate_inp)."""
    import transformers
    from conftest import write_gguf

    arch, path, prompts, expected = moe_model
    cls = {
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
    }[arch]
    model = cls.from_pretrained(path).eval()
    file = write_gguf(
        tmp_path / f"{arch}.gguf", model, {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}[arch], path
    )
    llm = LLM(str(file), dtype="float32", num_kv_blocks=64)
    cfg = llm.engine.model_config
    assert cfg.architecture == arch and cfg.num_experts_per_tok == model.config.num_experts_per_tok
    outs = llm.generate(prompt_token_ids=prompts, params=GREEDY)
    assert [o.token_ids for o in outs] == expected
