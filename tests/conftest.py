import os

# One thread per process: tests run engine processes, clients and Jupyter side by side on
# 2 cores, and OpenMP threads that spin-wait on a busy core made steps 10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Bench and sweep runs record into the run log: keep tests out of the user's (one file per session).
if "WORKBENCH_RUNS_DB" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _runs_dir = tempfile.mkdtemp(prefix="workbench-runs-")
    atexit.register(shutil.rmtree, _runs_dir, ignore_errors=True)
    os.environ["WORKBENCH_RUNS_DB"] = os.path.join(_runs_dir, "runs.sqlite")

# Triton reads this when @triton.jit runs, so it must be set before any kernel module is
# imported; without a GPU only the interpreter can run the kernels.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest  # noqa: E402


def make_tiny_model(path, arch: str = "llama", seed: int = 0, vocab: int = 256, **overrides):
    """A random-init transformers model saved with save_pretrained: the correctness oracle."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    if arch == "llama":
        common.update(tie_word_embeddings=True, rope_theta=10000.0)
        common.update(overrides)
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        common.update(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=1000000.0)
        common.update(overrides)
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        common.update(head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0, attention_bias=False)
        common.update(overrides)
        cfg = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "mixtral":
        common.update(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
        common.update(overrides)
        cfg = transformers.MixtralConfig(**common)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":
        common.update(head_dim=16, tie_word_embeddings=False, rope_theta=1000000.0, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
                      norm_topk_prob=False)
        common.update(overrides)
        cfg = transformers.Qwen3MoeConfig(**common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "olmoe":
        common.update(tie_word_embeddings=False, num_experts=16, num_experts_per_tok=4, intermediate_size=32,
                      norm_topk_prob=False, clip_qkv=None)
        common.update(overrides)
        cfg = transformers.OlmoeConfig(**common)
        model = transformers.OlmoeForCausalLM(cfg)
    elif arch == "mistral":
        common.update(tie_word_embeddings=False, sliding_window=None)
        common.update(overrides)
        cfg = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init puts tiny std on the weights; scale up so logits are decisive, not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_model(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model = make_tiny_model(path, "qwen3", seed=3)
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = make_tiny_model(path, "qwen2", seed=1)
    return path, model


def hf_greedy(model, prompt_ids, max_new_tokens):
    """Reference continuation from transformers, one prompt at a time (no padding effects)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()
