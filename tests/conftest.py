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

# Ray (tests/test_cluster.py) reads these when it is imported and when its processes start: no
# usage report, every port on loopback (a "cluster" of one machine's nodes), token authentication
# with this session's token. Set before anything imports ray.
import secrets  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))

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
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
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
        common.update(
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
        common.update(overrides)
        cfg = transformers.Qwen3MoeConfig(**common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "olmoe":
        common.update(
            tie_word_embeddings=False,
            num_experts=16,
            num_experts_per_tok=4,
            intermediate_size=32,
            norm_topk_prob=False,
            clip_qkv=None,
        )
        common.update(overrides)
        cfg = transformers.OlmoeConfig(**common)
        model = transformers.OlmoeForCausalLM(cfg)
    elif arch == "mistral":
        common.update(tie_word_embeddings=False, sliding_window=None)
        common.update(overrides)
        cfg = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(cfg)
    elif arch == "gemma3":
        # three layers: sliding, global, sliding; a window shorter than the tests' prompts
        common.update(
            head_dim=16,
            tie_word_embeddings=True,
            num_hidden_layers=3,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
        common.update(overrides)
        cfg = transformers.Gemma3TextConfig(**common)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init puts tiny std on the weights; scale up so logits are decisive, not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
            elif arch == "gemma3" and "norm" in name:
                p.normal_(0.0, 0.3)  # Gemma's norms scale by (1 + w) and start at w = 0: make w matter
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


def permute_like_llama_cpp(w, n_head: int):
    """The HF->GGUF converter's q/k row order for llama-arch files (written independently of the
    loader's inverse, for the tests)."""
    import numpy as np

    d = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        rows = w[h * d : (h + 1) * d]
        first, second = rows[: d // 2], rows[d // 2 :]
        out[h * d : (h + 1) * d][0::2] = first
        out[h * d : (h + 1) * d][1::2] = second
    return out


def write_gguf(path, model, arch: str, folder):
    """A transformers model as a GGUF file with llama.cpp's tensor names and metadata (float32
    tensors): `arch` "llama" (q/k rows permuted; with experts: how llama.cpp files Mixtral),
    "qwen3", "qwen3moe" or "olmoe". Stacks each MoE layer's experts as llama.cpp does. The tensors
    are read from the model's saved `folder` (per-expert names, as checkpoints store them)."""
    from pathlib import Path

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = model.config
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope))
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    }
    expert = {
        "w1": "ffn_gate_exps",
        "w3": "ffn_up_exps",
        "w2": "ffn_down_exps",
        "gate_proj": "ffn_gate_exps",
        "up_proj": "ffn_up_exps",
        "down_proj": "ffn_down_exps",
    }
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, a in sd.items():
        if name in glob:
            w.add_tensor(glob[name], a.copy())
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        if ".experts." in rest:  # ...experts.{e}.{proj}.weight
            e, proj = rest.split(".experts.", 1)[1].split(".")[:2]
            stacks.setdefault(f"blk.{i}.{expert[proj]}.weight", {})[int(e)] = a
            continue
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            a = permute_like_llama_cpp(a, heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            a = permute_like_llama_cpp(a, kv_heads)
        w.add_tensor(f"blk.{i}.{layer[rest]}", a.copy())
    for name, by_expert in stacks.items():
        w.add_tensor(name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_greedy_case(path, prompts, expected, params, settings: dict, *, preempts: bool = False) -> None:
    """The engine on `path` (fp32, 64 KV blocks, plus `settings`) gives transformers' greedy tokens
    (`expected`); with `preempts`, the case must really have preempted."""
    from workbench import LLM

    llm = LLM(str(path), **{"dtype": "float32", "num_kv_blocks": 64, **settings})
    outs = llm.generate(prompt_token_ids=prompts, params=params)
    assert [o.token_ids for o in outs] == expected
    if preempts:
        assert llm.metrics()["total_preemptions"] > 0


def assert_agree_up_to_near_ties(native, plain):
    """Same arithmetic up to fp32 summation order: log-probabilities agree to bf16 precision, and
    greedy tokens agree until a near-tie, where the two paths may pick different top tokens."""
    same = 0
    for a, b in zip(native, plain):
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) <= 0.05 * max(1.0, abs(b.logprobs[0].logprob))
        diverge = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if diverge is None:
            same += 1
            continue
        top = dict(b.logprobs[diverge].top)
        assert a.token_ids[diverge] in top, "the fast path chose a token outside torch's top 2"
        assert top[b.token_ids[diverge]] - top[a.token_ids[diverge]] < 0.1, "diverged without a near-tie"
    assert same >= len(native) // 2


def hf_greedy(model, prompt_ids, max_new_tokens):
    """Reference continuation from transformers, one prompt at a time (no padding effects)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def ray_cluster():
    """Two Ray nodes of one CPU on loopback, token auth on, the driver connected: one for the
    session (the cluster tests and the lab panel's). Only what this started is shut down."""
    ray = pytest.importorskip("ray", reason="workbench.cluster needs Ray: the [test] extra installs ray==2.60.0")
    from ray.cluster_utils import Cluster

    # set above, before ray was imported: loopback only, token auth on
    assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
