"""The C backend's second prefill path (`prefill_attention`): torch's SDPA (its flash attention,
whose matmuls take AMX where the CPU has it) for prompts of many new tokens, fresh or after cached
keys (later chunks, prefix hits: a mask lets each new token see the keys up to its own position),
our C kernel for the rest. bf16 both ways: tokens agree with torch's ops up to near-ties, as the C
kernels do (tests/test_cpu_kernels.py); the masked arithmetic itself is checked exactly in fp32 in
tests/test_prefill_attention.py."""

import pytest
import torch
from conftest import assert_agree_up_to_near_ties, make_tiny_model
from workbench_kernels import cpu

from workbench import LLM, SamplingParams
from workbench.engine import attention

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no C kernels here: {cpu.unavailable_reason()}")

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-sdpa")
    make_tiny_model(path, "llama", seed=5)
    # steps of up to 100 tokens, each above the one-call layer's rows (8, or 64 on the bf16 tiles),
    # so the op-by-op layer attends the prompts; the first 40-token prompt is split over two steps
    return LLM(str(path), dtype="bfloat16", max_num_batched_tokens=100, num_kv_blocks=64)


def _prompts():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (90, 70, 40, 40)]
    return prompts + [prompts[0][:48] + prompts[3]]  # a prefix hit: 3 cached blocks of the first


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Each call of the SDPA path: (new tokens, whether after cached keys) of its prompts."""
    calls, real = [], attention.sdpa_prompts

    def spy(q, k_cache, v_cache, slots, prompts, scale):
        calls.append([(p.n, p.mask is not None) for p in prompts])
        return real(q, k_cache, v_cache, slots, prompts, scale)

    monkeypatch.setattr(attention, "sdpa_prompts", spy)
    return calls


def _run(llm):
    llm.engine.reset_prefix_cache()
    first, *rest = _prompts()
    out = llm.generate(None, SP, prompt_token_ids=[first])  # cached, for the prefix hit
    return out + llm.generate(None, SP, prompt_token_ids=rest)


def test_sdpa_serves_fresh_and_cached_prompts_as_the_kernel_does(llm, sdpa_calls):
    llm.configure(cpu_kernels=True, prefill_attention="sdpa")
    st = llm.status()
    assert (st["attention_backend"], st["prefill_attention"]) == ("cpu", "sdpa")
    assert st["prefill_attention_reason"] == "asked for: torch's SDPA for prompts"
    sdpa = _run(llm)
    layers = llm.engine.model_config.num_hidden_layers
    calls = sdpa_calls[::layers]
    assert sdpa_calls == [c for c in calls for _ in range(layers)]  # every layer, the same split
    # the first prompt alone; then the 70 fresh and the 40's first 30; then (beside two decodes, 92
    # rows) its last 10 after its cached 30 (masked), the next 40 fresh and the prefix hit's 40 new
    # tokens after its 48 cached (masked)
    assert calls == [[(90, False)], [(70, False), (30, False)], [(10, True), (40, False), (40, True)]]
    assert llm.metrics()["total_prefix_hit_tokens"] >= 48
    llm.configure(prefill_attention="kernel")
    assert llm.status()["prefill_attention"] == "kernel"
    n = len(sdpa_calls)
    kernel = _run(llm)
    assert len(sdpa_calls) == n  # the kernel served every prompt
    assert_agree_up_to_near_ties(sdpa, kernel)
    llm.configure(cpu_kernels=False)  # torch's ops: the reference
    assert_agree_up_to_near_ties(sdpa, _run(llm))
    llm.configure(cpu_kernels=True, prefill_attention="auto")


def test_auto_measures_both_paths_on_a_cpu_and_says_so(llm):
    llm.configure(cpu_kernels=True, prefill_attention="auto")
    backend = llm.engine.runner.backend
    st = llm.status()
    assert st["prefill_attention"] in ("kernel", "sdpa")
    probe = min(512, llm.engine.runner.max_model_len)
    assert st["prefill_attention_reason"].startswith(f"auto, measured on one {probe}-token prompt at 4/2 heads")
    assert "our C kernel" in st["prefill_attention_reason"] and "SDPA" in st["prefill_attention_reason"]
    backend.pick_prefill({"kernel": 2e-3, "sdpa": 1e-3}, 4, 512)
    assert backend.prefill == "sdpa" and backend.sdpa_min_tokens == 64
    assert llm.status()["prefill_attention_reason"].endswith(
        "SDPA serves prompts of >= 64 new tokens (after cached keys too, masked), our C kernel the rest"
    )
    backend.pick_prefill({"kernel": 1e-3, "sdpa": 2e-3}, 4, 512)
    assert llm.status()["prefill_attention"] == "kernel"
    llm.configure(kv_cache_dtype="int8")  # SDPA reads 16-bit keys
    st = llm.status()
    assert st["prefill_attention"] == "kernel" and "quantised" in st["prefill_attention_reason"]
    llm.configure(kv_cache_dtype="auto")
