"""The Triton backend's second prefill path (`prefill_attention`): prompts with no cached context
attended by torch's SDPA over the keys RoPE wrote into the cache, instead of our extend kernel
(issue 50.3: the engine may pick the faster per shape, by measurement). On a CPU the kernel runs in
Triton's interpreter and SDPA in torch's math backend, both fp32: the tokens are transformers'."""

import random

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.engine import attention
from workbench.settings import kv_shaping_settings

from .conftest import hf_greedy

pytest.importorskip("triton")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _prompts(lengths=(1, 9, 16, 17, 30), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Each call of the SDPA path: its prompts' token counts (the real function runs)."""
    calls = []
    real = attention.sdpa_prompts

    def spy(q, k_cache, v_cache, slots, prompts, scale):
        calls.append([p.n for p in prompts])
        return real(q, k_cache, v_cache, slots, prompts, scale)

    monkeypatch.setattr(attention, "sdpa_prompts", spy)
    return calls


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_num_batched_tokens=24), dict(async_scheduling=True), dict(block_size=4)],
    ids=["one-step", "chunked", "async", "block4"],
)
def test_sdpa_prefill_gives_transformers_tokens(tiny_qwen2, sdpa_calls, settings):
    path, model = tiny_qwen2
    prompts = _prompts()
    llm = LLM(
        str(path), dtype="float32", num_kv_blocks=160 // settings.get("block_size", 16) * 4,
        attention_backend="triton", prefill_attention="sdpa", **settings,
    )  # fmt: skip
    assert llm.status()["prefill_attention"] == "sdpa"
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=GREEDY)]
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    layers = llm.engine.model_config.num_hidden_layers
    if "max_num_batched_tokens" in settings:  # first chunks are fresh; later ones read the cache (the kernel's)
        # step 2: the 16-token prompt's last 2 tokens (our kernel) beside two fresh ones (SDPA)
        assert sdpa_calls == [[1, 9, 14]] * layers + [[17, 3]] * layers
    else:
        assert sdpa_calls == [[1, 9, 16, 17, 30]] * layers


def test_sdpa_serves_fresh_prompts_beside_decodes_and_not_prefix_hits(tiny_qwen2, sdpa_calls):
    """A prompt arriving while another decodes shares its step (decodes first, then SDPA's part);
    a prompt whose prefix is cached reads cached keys: our kernel serves it."""
    path, model = tiny_qwen2
    first, second = _prompts((20, 12), seed=1)
    hit = first[:16] + [7, 8, 9]  # one 16-token block of `first` cached
    llm = LLM(str(path), dtype="float32", num_kv_blocks=48, attention_backend="triton", prefill_attention="sdpa")
    eng = llm.engine
    rids = [eng.add_request(prompt_token_ids=first, params=GREEDY)]
    done = {}

    def step():
        for c in eng.step():
            if c.output and c.output.finished:
                done[c.request_id] = c.output.token_ids

    step()
    step()  # `first` prefilled and decoding
    assert len(sdpa_calls) == eng.model_config.num_hidden_layers
    rids.append(eng.add_request(prompt_token_ids=second, params=GREEDY))
    step()
    assert eng.timeline.steps[-1].num_decode_tokens == 1 and sdpa_calls[-1] == [12]
    calls = len(sdpa_calls)
    rids.append(eng.add_request(prompt_token_ids=hit, params=GREEDY))
    while eng.has_unfinished_requests():
        step()
    assert len(sdpa_calls) == calls  # the prefix hit's step read the cache through our kernel
    assert eng.metrics()["total_prefix_hit_tokens"] >= 16
    assert [done[r] for r in rids] == [hf_greedy(model, p, GREEDY.max_tokens) for p in (first, second, hit)]


def test_prefill_attention_switches_live(tiny_qwen2):
    path, model = tiny_qwen2
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=48, attention_backend="triton", max_num_batched_tokens=24)
    eng = llm.engine
    rids = [eng.add_request(prompt_token_ids=p, params=GREEDY) for p in prompts]
    done, i = {}, 0
    while eng.has_unfinished_requests():
        eng.configure(prefill_attention=["sdpa", "kernel", "auto"][i % 3])
        for c in eng.step():
            if c.output and c.output.finished:
                done[c.request_id] = c.output.token_ids
        i += 1
    assert [done[r] for r in rids] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_status_says_which_prefill_path_serves_and_why(tiny_qwen2):
    path, _ = tiny_qwen2
    llm = LLM(str(path), dtype="float32", num_kv_blocks=48, attention_backend="triton")
    st = llm.status()
    assert st["prefill_attention"] == "kernel" and "auto off CUDA" in st["prefill_attention_reason"]
    llm.configure(prefill_attention="sdpa")
    assert llm.status()["prefill_attention"] == "sdpa"
    assert "prefill_attention" in kv_shaping_settings()  # the prefix cache keys its blocks by it
    llm.configure(kv_cache_dtype="int8")  # SDPA reads 16-bit keys: the kernel serves a quantised cache
    st = llm.status()
    assert st["prefill_attention"] == "kernel" and "quantised" in st["prefill_attention_reason"]
    llm.configure(kv_cache_dtype="auto")
    assert llm.status()["prefill_attention"] == "sdpa"
    llm.configure(attention_backend="torch")
    st = llm.status()
    assert st["prefill_attention"] is None and st["prefill_attention_reason"] is None
    with pytest.raises(ValueError, match="prefill_attention.*'auto', 'kernel', 'sdpa'"):
        llm.configure(prefill_attention="flash")
    assert llm.settings()["prefill_attention"] == "sdpa"  # the refused change changed nothing
    llm.configure(attention_backend="triton")
    assert llm.status()["prefill_attention"] == "sdpa"


def _paged(lens, ctx, hq=4, hkv=2, d=16, bs=4, seed=0):
    """Sequences of `lens` new tokens after `ctx` cached ones, at GQA 4:2, their keys scattered over
    permuted blocks of `bs` slots and all written: (q, caches, step tables, positions, slots, the
    reference's cu_seqlens and seq_lens)."""
    from workbench_kernels import reference

    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(32, generator=gen)
    k_cache, v_cache = torch.zeros(32, bs, hkv, d), torch.zeros(32, bs, hkv, d)
    tables, positions, slots, every, cu, used = [], [], [], [], [0], 0
    for n, c in zip(lens, ctx):
        table = blocks[used : used + -(-(n + c) // bs)].tolist()
        used += len(table)
        tables.append((table, n))
        every += [table[p // bs] * bs + p % bs for p in range(n + c)]
        slots += every[len(every) - n :]
        positions += list(range(c, c + n))
        cu.append(cu[-1] + n)
    k, v = (torch.randn(len(every), hkv, d, generator=gen) for _ in "kv")
    reference.write_kv_ref(k, v, k_cache, v_cache, torch.tensor(every))
    q = torch.randn(sum(lens), hq, d, generator=gen)
    seq_lens = torch.tensor([n + c for n, c in zip(lens, ctx)])
    return q, k_cache, v_cache, tables, positions, torch.tensor(slots), torch.tensor(cu), seq_lens


def test_sdpa_split_gives_sdpa_what_it_may_take():
    _, _, _, tables, positions, *_ = _paged([5, 6, 1], [0, 7, 0])
    split = attention.sdpa_split(tables, positions, 0, 1, False, 4, "cpu")  # fresh prompts only (CUDA's rule)
    assert [(p.at, p.n, p.key_slots) for p in split.prompts] == [(0, 5, None), (11, 1, None)]
    assert split.rest.rows.tolist() == list(range(5, 11))  # the second reads 7 cached keys: the kernel's
    assert split.rest.cu_seqlens_q.tolist() == [0, 6] and split.rest.seq_lens.tolist() == [13]
    assert split.rest.block_tables.tolist() == [tables[1][0]]
    split = attention.sdpa_split(tables, positions, 0, 2, True, 4, "cpu")  # masked (a CPU's rule), 2+ tokens
    assert [(p.at, p.n) for p in split.prompts] == [(0, 5), (5, 6)] and split.rest.rows.tolist() == [11]
    cached = split.prompts[1]
    table = tables[1][0]
    assert cached.key_slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(13)]
    assert cached.mask.shape == (6, 13) and cached.mask.sum(1).tolist() == [8, 9, 10, 11, 12, 13]
    assert attention.sdpa_split(tables, [9, *positions], 1, 1, False, 4, "cpu").prompts[0].at == 0  # after a decode
    assert attention.sdpa_split(tables, positions, 0, 7, False, 4, "cpu") is None  # the length floor
    assert attention.sdpa_split([], [4], 1, 1, True, 4, "cpu") is None  # decodes only


def test_sdpa_prompts_equal_the_reference_over_a_paged_cache():
    """Prompts at GQA 4:2 over permuted blocks of 4 slots, fresh and after 7 cached keys (masked)."""
    from workbench_kernels import reference

    q, k_cache, v_cache, tables, positions, slots, cu, seq_lens = _paged([5, 6, 12, 1], [0, 7, 0, 3])
    split = attention.sdpa_split(tables, positions, 0, 1, True, 4, "cpu")
    assert split.rest is None and [p.mask is not None for p in split.prompts] == [False, True, False, True]
    got = attention.sdpa_prompts(q, k_cache, v_cache, slots, split.prompts, 0.3)
    padded = [t + [0] * (5 - len(t)) for t, _ in tables]
    want = reference.extend_attention_ref(q, k_cache, v_cache, torch.tensor(padded), cu, seq_lens, 0.3)
    torch.testing.assert_close(got, want)


def test_auto_measures_both_paths_once_per_shape(tiny_qwen2):
    """auto's measurement (run on CUDA; here under the interpreter, to keep it working): both paths'
    times on the backend's cache shape, cached for the process."""
    path, _ = tiny_qwen2
    backend = LLM(str(path), dtype="float32", num_kv_blocks=48, attention_backend="triton").engine.runner.backend
    times = attention.measure_prefill(backend, 4, 40)
    assert set(times) == {"kernel", "sdpa"} and all(t > 0 for t in times.values())
    assert attention.measure_prefill(backend, 4, 40) is times


def test_auto_picks_the_faster_path_and_says_both_times(tiny_qwen2, sdpa_calls):
    """auto's choice from measured times (on CUDA; the times given here): SDPA where faster, for
    steps whose prompts are all of 512+ tokens; the kernel where SDPA is slower."""
    path, model = tiny_qwen2
    llm = LLM(str(path), dtype="float32", num_kv_blocks=48, attention_backend="triton", max_num_batched_tokens=512)
    backend = llm.engine.runner.backend
    backend.pick_prefill({"kernel": 2.5e-3, "sdpa": 1.25e-3}, 4, 2048)
    st = llm.status()
    assert st["prefill_attention"] == "sdpa"
    assert st["prefill_attention_reason"] == (
        "auto, measured on one 2048-token prompt at 4/1 heads, d16: our Triton kernel 2.500 ms, SDPA 1.250 ms; "
        "SDPA serves prompts of >= 512 tokens with no cached context, our Triton kernel the rest"
    )
    assert backend.sdpa_min_tokens == 512
    backend.sdpa_min_tokens = 100  # this model's context is 512 tokens: the floor scaled to it
    prompts = _prompts((300, 40), seed=2)
    for p in prompts:  # one at a time: the long prompt's step takes SDPA, the short one's our kernel
        assert llm.generate(prompt_token_ids=[p], params=GREEDY)[0].token_ids == hf_greedy(model, p, 6)
    assert sdpa_calls == [[300]] * llm.engine.model_config.num_hidden_layers
    backend.pick_prefill({"kernel": 1e-3, "sdpa": 1.5e-3}, 4, 2048)
    assert llm.status()["prefill_attention"] == "kernel"
    assert "SDPA 1.500 ms" in llm.status()["prefill_attention_reason"]
