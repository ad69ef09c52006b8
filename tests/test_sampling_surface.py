"""The rest of the sampling surface (issue 47, item 4): presence and frequency penalties,
logit_bias, min_tokens and prompt log-probabilities, against torch and transformers references."""

import random

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.engine import sampler
from workbench.engine.sequence import Sequence


def _seq(prompt, output, **params) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(**params), 0.0)
    seq.token_ids += list(output)  # as the scheduler appends sampled tokens
    return seq


def _reference(logits: torch.Tensor, seq: Sequence, eos=()) -> torch.Tensor:
    """OpenAI's documented formula, written out per token: mu[j] - c[j] * frequency - (c[j] > 0) *
    presence, then + bias[j]; min_tokens sets EOS and stop tokens to -inf."""
    sp = seq.params
    out = logits.clone()
    out_tokens = seq.output_token_ids
    for j in range(out.shape[-1]):
        c = out_tokens.count(j)
        if sp.min_tokens and len(out_tokens) < sp.min_tokens and (j in eos or j in (sp.stop_token_ids or ())):
            out[j] = float("-inf")
            continue
        out[j] = out[j] - c * sp.frequency_penalty - (1.0 if c else 0.0) * sp.presence_penalty
        out[j] = out[j] + (sp.logit_bias or {}).get(j, 0.0)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_penalties_and_bias_equal_the_formula_applied_to_the_logits(seed):
    rng = random.Random(seed)
    vocab = 40
    rows, seqs = [], []
    for _ in range(5):
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        params = dict(
            presence_penalty=rng.choice([0.0, 0.5, -1.25, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, -0.7, 1.5]),
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 4))} or None,
            max_tokens=20,
            min_tokens=rng.choice([0, 3, 20]),
            stop_token_ids=[rng.randrange(vocab)],
        )
        seqs.append(_seq([rng.randrange(vocab) for _ in range(5)], output, **params))
        rows.append(torch.randn(vocab, generator=torch.Generator().manual_seed(seed * 10 + len(rows))))
    logits = torch.stack(rows)
    got = sampler.apply_penalties(logits.clone(), seqs, eos_ids=(2,))
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], _reference(logits[i], seq, eos=(2,)), rtol=0, atol=1e-5)
    # greedy takes the processed argmax; a request without processors is left alone
    greedy = [_seq(s.prompt_token_ids, s.output_token_ids, **{**_params(s), "temperature": 0}) for s in seqs]
    assert sampler.sample(logits, greedy, (2,)) == [
        int(_reference(logits[i], s, (2,)).argmax()) for i, s in enumerate(seqs)
    ]
    plain = [_seq([1, 2], [3], temperature=0) for _ in seqs]
    assert sampler.sample(logits, plain) == logits.argmax(-1).tolist()


def _params(seq: Sequence) -> dict:
    import msgspec

    return {k: v for k, v in msgspec.structs.asdict(seq.params).items()}


def test_sampled_requests_never_draw_a_barred_or_minus_100_token():
    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 2] = 5.0  # EOS, the likeliest
    seq = _seq([1], [], temperature=1.0, max_tokens=8, min_tokens=4, logit_bias={7: -100.0})
    seq.generator = torch.Generator().manual_seed(0)
    drawn = {sampler.sample(logits, [seq], (2,))[0] for _ in range(300)}
    assert 2 not in drawn and 7 not in drawn and len(drawn) > 5


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, model = tiny_llama
    return LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8), model


def test_min_tokens_holds_off_eos_and_logit_bias_steers_greedy_output(llm):
    engine, _ = llm
    prompt = [5, 9, 33, 70]
    eos = 2
    # a strong bias makes EOS the greedy choice at once: without min_tokens the output is one token
    biased = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0})
    assert engine.generate(prompt_token_ids=[prompt], params=biased)[0].token_ids == [eos]
    held = SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100.0}, min_tokens=6)
    out = engine.generate(prompt_token_ids=[prompt], params=held)[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and eos not in out.token_ids[:6]
    assert out.finish_reason == "stop"
    # presence/frequency penalties change greedy repetition and the engine equals the sampler's reference
    plain = engine.generate(prompt_token_ids=[prompt], params=SamplingParams(max_tokens=24, temperature=0))[0]
    pen = SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    penalised = engine.generate(prompt_token_ids=[prompt], params=pen)[0]
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))


def test_a_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(llm):
    engine, _ = llm
    with pytest.raises(ValueError, match=r"logit_bias names token ids outside the vocabulary \[0, 256\): \[999\]"):
        engine.generate(prompt_token_ids=[[5, 6]], params=SamplingParams(logit_bias={999: 1.0}))
    # ignore_eos: an unseeded draw may end at EOS (a fresh-clone run drew it at the second token)
    after = engine.generate(prompt_token_ids=[[5, 6]], params=SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(after.token_ids) == 3 and after.finish_reason == "length"


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16}, {"prefix_caching": True}])
def test_prompt_logprobs_equal_transformers_on_the_same_weights(tiny_llama, settings):
    """fp32, every position: chunked prefill (16-token chunks over a 45-token prompt) and a warm
    prefix cache (which a prompt_logprobs request does not use: every position is computed)."""
    path, model = tiny_llama
    engine = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8, **settings)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (45, 9, 2)]
    engine.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=2))  # warms the prefix cache
    outs = engine.generate(
        prompt_token_ids=prompts, params=SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    )
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for p in range(1, len(prompt)):
            assert lps[p].token_id == prompt[p]
            assert lps[p].logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
            assert [t for t, _ in lps[p].top] == ref[p - 1].topk(2).indices.tolist()
        assert out.metrics.prefix_hit_tokens == 0


def test_a_processed_request_takes_no_drafts_and_answers_as_without_speculation(tiny_llama):
    path, _ = tiny_llama
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]  # n-gram speculation finds drafts here
    params = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=0.4, logit_bias={9: 1.5})
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64).generate(prompt_token_ids=[prompt], params=params)[0]
    spec = LLM(str(path), dtype="float32", num_kv_blocks=64, speculative="ngram", num_speculative_tokens=3)
    out = spec.generate(prompt_token_ids=[prompt], params=params)[0]
    assert out.token_ids == plain.token_ids and out.metrics.spec_proposed == 0
    free = spec.generate(prompt_token_ids=[prompt], params=SamplingParams(max_tokens=12, temperature=0))[0]
    assert free.metrics.spec_proposed > 0  # the same prompt without processors does take drafts
