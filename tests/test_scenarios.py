"""The optimisation scenarios of `workbench bench --scenario` run and report what they claim."""

import pytest

from workbench.bench import scenarios

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from workbench.engine.llm_engine import LLMEngine

    return LLMEngine(None, num_kv_blocks=256)


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
    assert engine.settings.speculative == "off"


def test_quant_scenario_restores_weights(engine):
    before = engine.weights_checksum()
    out = scenarios.quant_scenario(engine, output_len=8)
    assert {"none", "int8", "int4", "int8_vs_bf16", "int4_vs_bf16"} <= set(out)
    assert engine.settings.quantization == "none" and engine.weights_checksum() == before


def test_unknown_scenario_named():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; known: prefix, quant, spec"):
        scenarios.run_scenarios(["nope"], model="/nonexistent")
