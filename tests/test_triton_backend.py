"""The engine on our Triton kernels (interpreted on a CPU) gives the torch backend's tokens, in
fp32 and in bf16 (the engine's default dtype on a CPU, where the interpreter's own bf16 dots are
wrong and the launchers widen them to fp32)."""

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
    model = llm.engine.runner.model
    assert model.fused_ops is not None and model.fused_layers_reason is None  # issue 50.2: the fused layer ops
    triton_out = llm.generate(prompt_token_ids=_prompts(), params=params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]


def test_the_embedded_model_in_bf16_answers_on_the_triton_backend_as_on_torch():
    """A tester's case: bf16 on a CPU answered 'ortiumortium...' on the Triton backend."""
    llm = LLM(num_kv_blocks=32)
    assert llm.status()["dtype"] == "bfloat16"
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = "The capital of France is"
    llm.configure(attention_backend="torch")
    expected = llm.generate(prompt, params)[0]
    assert expected.text.startswith(" Paris")
    llm.configure(attention_backend="triton")
    status = llm.status()
    assert status["attention_backend"] == "triton"
    assert "interpreter" in status["attention_backend_reason"] and "slower" in status["attention_backend_reason"]
    got = llm.generate(prompt, params)[0]
    assert got.token_ids == expected.token_ids


def test_triton_backend_matches_torch_in_bf16(tiny_qwen2):
    """Prefill chunks and decodes of a tiny model in bf16: the same greedy tokens as torch's backend."""
    path, _ = tiny_qwen2
    params = SamplingParams(max_tokens=6, temperature=0)
    common = dict(dtype="bfloat16", num_kv_blocks=48, block_size=16, cpu_kernels=False, max_num_batched_tokens=24)
    torch_out = LLM(str(path), attention_backend="torch", **common).generate(prompt_token_ids=_prompts(), params=params)
    triton_out = LLM(str(path), attention_backend="triton", **common).generate(
        prompt_token_ids=_prompts(), params=params
    )
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


def test_the_triton_backend_gives_decode_its_longest_context_from_the_host():
    """The split count comes from the host's positions, not from seq_lens.max() read back from the
    device in every layer (a sync per layer on a GPU); prefill tokens after the decodes do not count."""
    import torch

    from workbench.engine.attention import AttnMetadata, TritonAttention

    kernel_prefill = TritonAttention.__new__(TritonAttention)  # no cache: prepare reads only `prefill` ("kernel")
    meta = AttnMetadata(torch.zeros(5, dtype=torch.int64), 3, None, None, None, None, None)
    TritonAttention.prepare(kernel_prefill, meta, [], [40, 7, 99, 500, 501])
    assert meta.decode_max_seq_len == 100
    prefill_only = AttnMetadata(torch.zeros(2, dtype=torch.int64), 0, None, None, None, None, None)
    TritonAttention.prepare(kernel_prefill, prefill_only, [], [0, 1])
    assert prefill_only.decode_max_seq_len is None
