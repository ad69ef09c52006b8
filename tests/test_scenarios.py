"""The optimisation scenarios of `workbench bench --scenario` run and report what they claim."""

import pytest

from workbench.bench import scenarios

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from workbench import LLM

    return LLM(None, num_kv_blocks=256)


def test_prefix_scenario_hits_the_shared_prompt(engine):
    out = scenarios.prefix_scenario(engine, num_requests=3, prompt_len=96, output_len=2)
    assert out["workload"]["shared_prefix_tokens"] == 86
    assert out["off"]["prefix_hit_rate"] == 0.0
    assert out["on"]["prefix_hit_rate"] > 0.5  # two of three requests reuse 80 of 96 tokens
    assert out["ttft_p50_ratio"] > 0 and out["target"] == 3.0


def test_spec_scenario_reports_acceptance(engine):
    out = scenarios.spec_scenario(engine, output_len=24, k=3)
    assert out["off"]["acceptance_rate"] == 0.0
    assert out["ngram"]["acceptance_rate"] > 0.3  # the answer copies the prompt
    assert out["ngram"]["tokens"] == out["off"]["tokens"]
    assert set(out) >= {"ngram_vs_off", "draft_vs_off", "target"}
    assert engine.settings()["speculative"] == "off"


def test_quant_scenario_restores_weights(engine):
    before = engine.weights_checksum()
    out = scenarios.quant_scenario(engine, output_len=8)
    assert {"none", "int8", "int4", "int8_vs_bf16", "int4_vs_bf16"} <= set(out)
    assert engine.settings()["quantization"] == "none" and engine.weights_checksum() == before


def test_long_prompt_scenario_measures_both_budgets_and_puts_the_settings_back(engine):
    before = engine.settings()
    out = scenarios.long_prompt_scenario(engine, prompt_len=600, streams=2, rounds=1)
    for mode in ("off", "on"):
        r = out[mode]
        assert r["worst_gap_ms"] >= r["stream_gap_p50_ms"] > 0 and r["ttft_s"] > 0 and r["prefill_steps"] >= 1
    assert out["ttft_on_vs_off"] > 0 and out["worst_gap_ms"] == out["on"]["worst_gap_ms"]
    assert out["bounds"]["off"] == {"attention_aware_budget": False, "step_time_target_ms": 0}
    after = engine.settings()
    for key in ("attention_aware_budget", "step_time_target_ms", "prefix_caching"):
        assert after[key] == before[key], key
    assert not engine.engine.has_unfinished_requests()


def test_structured_scenario_emits_the_same_tokens_free_and_constrained(engine):
    """Free and constrained runs emit the same number of tokens (the schema never closes within
    max_tokens), jump-forward saves steps and keeps its proposals, and the setting is put back."""
    out = scenarios.structured_scenario(engine, num_requests=4, output_len=24, rounds=1)
    runs = ("free", "json", "json_no_jump")
    assert {out[m]["tokens"] for m in runs} == {4 * 24}
    assert out["json"]["steps"] < out["json_no_jump"]["steps"] == out["free"]["steps"]
    assert 0 < out["json"]["jump_forward_tokens"] <= out["json"]["jump_forward_proposed"]
    assert out["free"]["mask_share"] == 0.0 < out["json_no_jump"]["mask_share"]
    assert out["structured_vs_free"] > 0 and out["target"] == 0.95 and "vllm" not in out
    assert engine.settings()["jump_forward"] is True and not engine.engine.has_unfinished_requests()


def test_unknown_scenario_named():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; known: prefix, quant, spec"):
        scenarios.run_scenarios(["nope"], model="/nonexistent")


# -- the quantisation peer: transformers' own quantised path (TorchAoConfig), on a tiny model ----------
N_PEER = 5


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    from workbench import LLM

    return LLM(str(tiny_llama[0]), num_kv_blocks=64)


def test_quant_peer_bf16_is_transformers_greedy_generate(tiny_llama, tiny_engine):
    """The peer's unquantised run is transformers' plain greedy `generate` on the same weights and
    prompt (same tokens), and its int8/int4 runs really quantise the linear layers."""
    import torch
    import transformers
    from conftest import hf_greedy

    path = str(tiny_llama[0])
    ids = scenarios._prompt_tokens(tiny_engine)[:12]
    records = {}
    out = scenarios.hf_quant_peer(path, ids, N_PEER, dtype=torch.bfloat16, group_size=64, records=records)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    expected = hf_greedy(reference, ids, N_PEER)
    assert expected and records["none"].token_ids[: len(expected)] == expected  # plain generate may stop at EOS
    assert len(records["none"].token_ids) == N_PEER  # the peer ignores EOS
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in reference.modules())
    assert out["none"]["quantized_linears"] == f"0/{n_linear}"
    for mode in ("int8", "int4"):
        assert "error" not in out[mode], out[mode]
        assert out[mode]["tokens"] == N_PEER and out[mode]["decode_tok_s"] > 0
        assert out[mode]["quantized_linears"] == f"{n_linear - 1}/{n_linear}"  # all but the (tied) lm_head
        assert out[f"{mode}_vs_bf16"] == pytest.approx(out[mode]["decode_tok_s"] / out["none"]["decode_tok_s"])
    assert out["backend"] == "transformers TorchAoConfig" and out["versions"]["torchao"]


def test_quant_scenario_reports_the_peer_beside_ours(tiny_llama, tiny_engine):
    out = scenarios.quant_scenario(tiny_engine, output_len=N_PEER, hf_path=str(tiny_llama[0]))
    assert out["workload"] == {"prompt_tokens": 32, "max_tokens": N_PEER, "int4_group_size": 64}
    hf = out["hf"]
    assert hf["group_size"] == 64
    for mode in ("none", "int8", "int4"):
        assert out[mode]["tokens"] == hf[mode]["tokens"] == N_PEER
        assert out["vs_hf"][mode] == pytest.approx(out[mode]["decode_tok_s"] / hf[mode]["decode_tok_s"])
    assert set(hf) >= {"int8_vs_bf16", "int4_vs_bf16"} and hf["int4_vs_bf16"] > 0
    assert tiny_engine.settings()["quantization"] == "none"


def test_quant_peer_reports_a_failing_mode_instead_of_crashing(tiny_llama, tiny_engine, monkeypatch):
    from workbench.bench import peers

    def no_int4(mode, group_size=128, device="cpu"):
        if mode == "int4":
            raise ImportError("no int4 here")
        return real(mode, group_size, device)

    real = peers.torchao_config
    monkeypatch.setattr(peers, "torchao_config", no_int4)
    out = scenarios.quant_scenario(tiny_engine, output_len=3, hf_path=str(tiny_llama[0]))
    assert out["hf"]["int4"] == {"error": "ImportError: no int4 here"}
    assert out["hf"]["int4_vs_bf16"] is None and out["vs_hf"]["int4"] is None
    assert out["hf"]["int8"]["tokens"] == 3 and out["hf"]["int8_vs_bf16"] > 0
    assert out["int4"]["tokens"] == 3  # ours still measured
    ratios = scenarios._ratios({"quant": out})
    assert ratios["hf_int4_vs_bf16"] is None and ratios["int8_vs_hf"] > 0
    assert [t["name"] for t in scenarios._targets(ratios)] == ["int4_vs_bf16", "int8_vs_bf16"]


def test_stall_scenario_runs_on_an_engine_process_of_its_own(tmp_path):
    """`--scenario stall` alone loads no model in this process; every oversized prompt is refused
    while the stream runs, and the report carries the engine it measured."""
    from http_helpers import make_tiny_tokenized_model

    model = make_tiny_tokenized_model(tmp_path / "m")
    out = scenarios.run_scenarios(["stall"], str(model), quick=True, record=False, dtype="float32")
    st = out["stall"]
    assert st["workload"]["context"] == 2048 and st["workload"]["oversized_prompts"] == 4
    assert list(st["attacks"]) == ["python_text", "http_text", "http_token_ids", "near_bound"]
    for name, attack in st["attacks"].items():  # every attack refused, each for its own reason
        assert attack["errors"] and "accepted" not in attack["errors"], (name, attack)
        assert set(attack["worst_gap_ms"]) == {"python_stream", "http_stream"}
    assert "at least" in st["attacks"]["http_text"]["errors"][0]  # from its length
    assert "maximum context length" in st["attacks"]["http_token_ids"]["errors"][0]  # from the count of ids
    assert "alone are" in st["attacks"]["near_bound"]["errors"][0]  # from a prefix's tokens
    assert min(st["workload"]["stream_tokens"].values()) > 20 and st["worst_gap_vs_itl"] > 0
    assert out["model"] == st["engine"]["model"] and out["settings"]["dtype"] == "float32"
    assert out["engine_status"]["max_token_chars"] == 81 and "pid" not in out["engine_status"]
    assert [t["name"] for t in out["targets"]] == ["stall_worst_gap_vs_itl"]
