"""The engine's host memory (`models.host_memory`): what does not fit is refused before it is
taken, and a kernel's copy of the weights that does not fit is not made, the layer serving from
the weights as they are with the same outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_agree_up_to_near_ties, make_tiny_model
from workbench_kernels import cpu, hostmem

from workbench import LLM, SamplingParams
from workbench.errors import EngineStartError
from workbench.models.host_memory import HostMemory, quantize_bytes
from workbench.models.loader import model_config

# A model whose layers' copies are ~12.5 MB, in a limit that holds its weights and cache only.
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2)
TIGHT = dict(host_memory_mb=13, num_kv_blocks=16)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide-llama")
    make_tiny_model(path, "llama", seed=5, **WIDE)
    return path


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (1, 9, 40, 120)]


def test_the_machines_available_memory_is_read():
    total, available = hostmem.total_bytes(), hostmem.available_bytes()
    assert total > 0 and 0 < available <= total
    mem = HostMemory(None)
    room, bound = mem.room()
    assert room == pytest.approx(hostmem.available_bytes() - mem.reserve, abs=256 << 20)
    assert "available" in bound and mem.reserve >= 512 << 20
    assert mem.affords(room // 2) and not mem.affords(room + (1 << 30))


def test_a_model_that_cannot_fit_is_refused_before_it_is_read():
    """Llama-3-8B's shape (15 GiB of bf16 weights) in 4 GiB: refused from its config, naming what
    it needs and what bounds it, in the process and from an engine process alike."""
    before = hostmem.available_bytes()
    with pytest.raises(MemoryError, match=r"shape:llama3-8b \(15\.0 GiB of weights.*host_memory_mb=4096"):
        LLM("shape:llama3-8b", host_memory_mb=4096)
    assert hostmem.available_bytes() > before - (1 << 30)  # nothing of it was made
    from workbench import start_engine

    with pytest.raises(EngineStartError, match=r"MemoryError: the model shape:llama3-8b .*\(host_memory_mb=4096"):
        start_engine("shape:llama3-8b", name="too-big", host_memory_mb=4096, timeout=120)


@pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")
@pytest.mark.parametrize("gemm", ["tiles", "bf16", "fp32"])
def test_copies_that_do_not_fit_are_not_made_and_the_outputs_stay(wide_llama, gemm, monkeypatch):
    """Large steps on each compute path, in a limit that holds the weights and the cache only: no
    layer gets its copy for that path (the tiles' then lie in the weights' own bytes, even off AMX;
    oneDNN's and the fp32 copy are made per call), status() says so, and the outputs are torch's ops'
    up to near-ties."""
    if gemm == "tiles" and not cpu.tiles_available():
        pytest.skip(f"the bf16 tiles are the avx512_bf16 build's; this host runs {cpu.variant()}")
    monkeypatch.setattr(cpu, "_gemm", (gemm, f"forced to {gemm} by the test", dict.fromkeys(cpu.GEMM_PATHS, 1.0)))
    if gemm == "tiles":
        cpu.set_amx(False)  # where the tiles would keep a copy beside the weights (on AMX they hold them anyway)
    try:
        llm = LLM(str(wide_llama), dtype="bfloat16", **TIGHT)
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        native = llm.generate(None, sp, prompt_token_ids=_prompts())
        status = llm.status()
        model = llm.engine.runner.model
        layer_linears = [lin for layer in model.layers for lin in layer.linears()]
        kind = {"tiles": "tiles", "bf16": "onednn", "fp32": "fp32"}[gemm]
        assert all(kind in lin.skipped for lin in layer_linears)
        assert status["host_memory"]["copies_skipped"][kind] >= len(layer_linears)
        assert "not made for want of memory" in status["compute_path_reason"]
        copies = {k: v for k, v in status["memory_mb"].items() if k not in ("weights", "kv_cache")}
        assert sum(copies.values()) < 0.5, copies  # the output head's, at most (0.25 MiB)
        if gemm == "tiles":
            assert all(lin.held_once for lin in layer_linears)
            assert "a copy for the tiles did not fit in memory" in status["compute_path_reason"]
        llm.configure(cpu_kernels=False)
        assert not any(lin.skipped or lin.held_once for lin in layer_linears)  # laid back
        assert_agree_up_to_near_ties(native, llm.generate(None, sp, prompt_token_ids=_prompts()))
    finally:
        cpu.set_amx(None)


def test_a_live_change_that_cannot_fit_is_refused_and_the_engine_keeps_serving(wide_llama, tiny_llama):
    """A quantisation's codes, or a draft model, beyond the limit: MemoryError naming them,
    nothing changed, the same answers after. The estimate of the codes holds what they took."""
    llm = LLM(str(wide_llama), dtype="bfloat16", **TIGHT)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(None, sp, prompt_token_ids=_prompts())]
    settings = llm.settings()
    with pytest.raises(MemoryError, match=r"quantization='int8' .*host_memory_mb=13"):
        llm.configure(quantization="int8")
    with pytest.raises(MemoryError, match=r"a self-int4 draft"):
        llm.configure(speculative="draft")
    assert llm.settings() == settings and llm.engine.spec.draft is None
    assert [o.token_ids for o in llm.generate(None, sp, prompt_token_ids=_prompts())] == before

    roomy = LLM(str(wide_llama), dtype="bfloat16", num_kv_blocks=16)
    model = roomy.engine.runner.model
    for mode in ("int8", "int4"):
        roomy.configure(quantization="none")
        held = roomy.engine.memory.held()
        estimate = quantize_bytes(model, mode)
        roomy.configure(quantization=mode)
        grew = roomy.engine.memory.held() - held
        assert grew <= estimate <= 1.25 * grew + (64 << 10), (mode, grew, estimate)


def test_a_draft_model_that_cannot_fit_is_refused(tiny_llama, wide_llama):
    """A named draft is checked like a model at start: its weights and its cache beside the target's."""
    path, _ = tiny_llama
    config = model_config(path)
    assert config is not None and config.hidden_size == 64
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=16, host_memory_mb=1)
    with pytest.raises(MemoryError, match=r"the draft model .*wide-llama.*\(host_memory_mb=1,"):
        llm.configure(speculative="draft", draft_model=str(wide_llama))
    assert llm.settings()["speculative"] != "draft"


def _peak_and_now() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process, bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) << 10 for k in ("VmHWM", "VmRSS"))


def test_a_self_int4_draft_is_built_a_layer_at_a_time():
    """Where the layers hold their weights as the tiles (AMX), a self-int4 draft reads each as a copy:
    built a layer at a time, the process's peak grows by about one layer's copies and the output
    head's (it took a copy of every weight before: 256 MiB more for SmolLM2), and it keeps its codes
    alone."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) from now on
    except OSError as e:
        pytest.skip(f"this kernel does not reset a process's peak memory (/proc/self/clear_refs): {e}")
    llm = LLM()
    model = llm.engine.runner.model
    weights = sum(model.originals().values())
    sp = SamplingParams(max_tokens=8, temperature=0)
    plain = llm.generate(prompt_token_ids=[[5, 9, 17, 3]], params=sp)[0].token_ids
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _, before = _peak_and_now()
    llm.configure(speculative="draft")
    peak, _ = _peak_and_now()
    draft = llm.engine.spec.draft.runner.model
    held = sum(lin.storage.nbytes for lin in model.linears() if lin.held_once)
    layer = max(sum(lin.storage.nbytes for lin in layer.linears()) for layer in model.layers)
    own = llm.status()["memory_mb"]["draft"] * 2**20  # its codes and KV cache
    assert peak - before < own + 3 * layer + model.lm_head.storage.nbytes + (64 << 20), (peak - before, held)
    if held:
        assert peak - before < own + weights / 2  # not a copy of every weight
    assert all(lin.storage is None for lin in draft.linears())
    assert llm.generate(prompt_token_ids=[[5, 9, 17, 3]], params=sp)[0].token_ids == plain
