"""Model loading: Hugging Face folders, GGUF files, the embedded default and its cache."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import permute_like_llama_cpp

from workbench.models import embedded, loader
from workbench.models import gguf as gguf_format
from workbench.models import hf as hf_folder
from workbench.models.loader import ModelConfig, load_model
from workbench.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


# ----------------------------------------------------------------------------- tiny HF models
def _tiny_llama(tmp_path: Path, **overrides) -> tuple[Path, dict[str, torch.Tensor]]:
    kwargs = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2:1
        tie_word_embeddings=True,
        rope_theta=5000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    out = tmp_path / "tiny-llama"
    model.save_pretrained(out, safe_serialization=True)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tiny_qwen2(tmp_path: Path, **save_kwargs) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg = transformers.Qwen2Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        eos_token_id=[5, 7],
    )
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(cfg)
    out = tmp_path / "tiny-qwen2"
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_weights_equal(loaded: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tied: bool):
    want = {k for k in ref if not (tied and k == "lm_head.weight")}
    assert set(loaded) == want
    for k in want:
        assert loaded[k].dtype == torch.float32
        torch.testing.assert_close(loaded[k], ref[k], rtol=0, atol=0, msg=k)


def test_tiny_llama_gqa_tied(tmp_path):
    path, ref = _tiny_llama(tmp_path)
    m = load_model(path, dtype=torch.float32)
    c = m.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 96, 32, 48)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 8)
    assert c.rope_theta == 5000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 128
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert c.path == str(path) and c.name == "tiny-llama"
    _assert_weights_equal(m.weights, ref, tied=True)
    assert "lm_head.weight" not in m.weights
    assert m.tokenizer is None  # no tokenizer.json in the folder
    # dtype cast, and a checksum that depends on the bytes but not on the load
    bf = load_model(path)
    assert all(t.dtype == torch.bfloat16 for t in bf.weights.values())
    assert bf.checksum == load_model(path).checksum != m.checksum
    assert len(m.checksum) >= 16


def test_tiny_qwen2_untied_bias_sharded(tmp_path):
    path, ref = _tiny_qwen2(tmp_path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    m = load_model(str(path), dtype=torch.float32)
    c = m.config
    assert c.architecture == "qwen2" and c.attention_bias and not c.tie_word_embeddings
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 1, 8)
    assert c.eos_token_ids == [5, 7] and c.bos_token_id is None
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    _assert_weights_equal(m.weights, ref, tied=False)
    assert "model.layers.1.self_attn.k_proj.bias" in m.weights
    assert "model.layers.1.self_attn.o_proj.bias" not in m.weights


def test_rope_scaling_kept(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path, _ = _tiny_llama(tmp_path, rope_scaling=dict(scaling), max_position_embeddings=512)
    c = load_model(path, dtype=torch.float32).config
    assert c.rope_scaling == scaling and c.rope_theta == 5000.0

    # transformers 4.x layout: rope_theta + rope_scaling with the old "type" key
    legacy = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "sliding_window": 4096,
    }
    c = ModelConfig.from_hf_config(legacy, "/x/m")
    assert c.architecture == "mistral" and c.num_key_value_heads == 2 and c.head_dim == 4
    assert c.rope_theta == 1e6 and c.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert c.sliding_window == 4096 and c.eos_token_ids == [] and c.name == "m"
    # round trip through the config.json the converter writes
    again = ModelConfig.from_hf_config(c.to_hf_config(), "/x/m")
    assert again == c


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_model(empty)

    path, _ = _tiny_llama(tmp_path)
    (path / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no model weights.*safetensors"):
        load_model(path)
    (tmp_path / "moved.safetensors").rename(path / "model.safetensors")

    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM.*supported: LlamaForCausalLM"):
        load_model(path)

    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    cfg["num_hidden_layers"] = 3  # more layers than the checkpoint holds
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing weights model\.layers\.2\."):
        load_model(path)

    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="unsupported model file"):
        load_model(odd)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf")


def test_sharded_missing_shard(tmp_path):
    path, _ = _tiny_qwen2(tmp_path, max_shard_size="20KB")
    victim = sorted(path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(path)


# ----------------------------------------------------------------------------- tiny GGUF files
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he"]
_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tiny_vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return _SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]


def _write_tiny_gguf(path: Path, ref: dict[str, torch.Tensor], n_head: int, n_kv: int, tied: bool) -> Path:
    import gguf

    tokens = _tiny_vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(5000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS)))
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(_TEMPLATE)
    names = {
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
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for hf, t in ref.items():
        if hf == "lm_head.weight" and tied:
            continue
        if hf in names:
            name = names[hf]
        else:
            i, rest = hf.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{i}.{layer[rest]}"
        a = t.float().numpy().copy()
        if hf.endswith("q_proj.weight"):
            a = permute_like_llama_cpp(a, n_head)
        elif hf.endswith("k_proj.weight"):
            a = permute_like_llama_cpp(a, n_kv)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    _, ref = _tiny_llama(tmp_path, vocab_size=len(_tiny_vocab()))
    return _write_tiny_gguf(tmp_path / "tiny.gguf", ref, n_head=4, n_kv=2, tied=True), ref


def test_gguf_load_unpermutes_and_maps_names(tiny_gguf):
    path, ref = tiny_gguf
    m = load_model(path, dtype=torch.float32)
    c = m.config
    assert (c.architecture, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == ("llama", 4, 2, 8)
    assert c.tie_word_embeddings and c.rope_theta == 5000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 128 and c.vocab_size == len(_tiny_vocab())
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    _assert_weights_equal(m.weights, ref, tied=True)
    from workbench.models.gguf import read_gguf_config

    meta_only = read_gguf_config(path)  # what the simulator reads: the same shape, no weights loaded
    assert (meta_only.architecture, meta_only.num_hidden_layers, meta_only.head_dim, meta_only.vocab_size) == (
        c.architecture,
        c.num_hidden_layers,
        c.head_dim,
        c.vocab_size,
    )

    tok = m.tokenizer
    assert tok is not None and tok.vocab_size == len(_tiny_vocab())
    ids = tok.encode(" the<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["Ġthe", "<|im_end|>"]
    assert tok.decode(ids) == " the" and tok.decode(ids, skip_special_tokens=False) == " the<|im_end|>"
    assert tok.encode("42") == [tok.token_to_id("4"), tok.token_to_id("2")]
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unpermute_inverts_permute():
    w = torch.arange(6 * 16 * 3, dtype=torch.float32).reshape(6 * 16, 3)
    permuted = torch.from_numpy(permute_like_llama_cpp(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(gguf_format._unpermute_qk(permuted, 6), w)


# ----------------------------------------------------------------------------- default + cache
@pytest.fixture
def tiny_default(tiny_gguf, tmp_path, monkeypatch):
    """Point the embedded default at the tiny GGUF and the cache at a temp folder."""
    path, ref = tiny_gguf
    cache = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(cache))
    monkeypatch.setattr(loader, "default_gguf_path", lambda: path)
    calls = []
    real = embedded.convert_gguf_to_hf

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(embedded, "convert_gguf_to_hf", counting)
    return cache / "models", ref, calls


def _entries(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_default_converts_once_then_loads_from_cache(tiny_default):
    models, ref, calls = tiny_default
    a = load_model(None, dtype=torch.float32)
    assert len(calls) == 1
    (folder,) = _entries(models)
    assert folder.startswith("smollm2-135m-") and a.config.path == str(models / folder)
    assert a.config.name == "smollm2-135m"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (models / folder / f).is_file()
    tcfg = json.loads((models / folder / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == _TEMPLATE and tcfg["eos_token"] == "<|im_end|>"
    # stored in bf16: weights equal the bf16 rounding of the originals
    for k, v in a.weights.items():
        torch.testing.assert_close(v, ref[k].to(torch.bfloat16).float(), rtol=0, atol=0, msg=k)

    b = load_model("smollm2-135m", dtype=torch.float32)
    assert len(calls) == 1  # reloaded from the cache
    assert b.checksum == a.checksum and b.config == a.config
    assert b.tokenizer.encode(" the") == a.tokenizer.encode(" the")


def test_interrupted_conversion_leaves_nothing_complete(tiny_default, monkeypatch):
    models, _, calls = tiny_default

    def boom(*a, **k):
        raise RuntimeError("disk full (simulated)")

    # weights are written, then the tokenizer writer fails midway
    real_save_tokenizer = hf_folder._save_tokenizer
    monkeypatch.setattr(hf_folder, "_save_tokenizer", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        load_model(None)
    assert _entries(models) == []  # neither a target nor a temp folder is left

    # a converter killed outright leaves its temp folder; it must not be mistaken for the model
    stale = models / ".smollm2-135m-0000.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    monkeypatch.setattr(hf_folder, "_save_tokenizer", real_save_tokenizer)
    m = load_model(None, dtype=torch.float32)
    assert len(calls) == 2
    assert m.tokenizer is not None
    names = _entries(models)
    assert len(names) == 1 and names[0].startswith("smollm2-135m-")  # stale temp folder cleaned up


def test_broken_cache_folder_is_reconverted(tiny_default):
    models, _, calls = tiny_default
    first = load_model(None)
    folder = Path(first.config.path)
    (folder / embedded._COMPLETE_MARKER).unlink()  # e.g. someone deleted files by hand
    (folder / "model.safetensors").write_bytes(b"garbage")
    again = load_model(None)
    assert len(calls) == 2 and again.checksum == first.checksum
    assert _entries(models) == [folder.name]


def test_concurrent_converters(tiny_default, monkeypatch):
    """Two converters that both finish writing before either renames: one wins, both succeed."""
    models, _, calls = tiny_default
    barrier = threading.Barrier(2, timeout=60)
    real_write = embedded.write_hf_dir

    def write_then_wait(*a, **k):
        real_write(*a, **k)
        barrier.wait()

    monkeypatch.setattr(embedded, "write_hf_dir", write_then_wait)
    results, errors = [], []

    def worker():
        try:
            results.append(load_model(None, dtype=torch.float32))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(calls) == 2 and len(results) == 2
    assert results[0].checksum == results[1].checksum
    (name,) = _entries(models)
    assert embedded._is_complete(models / name)


# ----------------------------------------------------------------------------- the real default
@pytest.mark.slow
def test_embedded_default_converts_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    t0 = time.perf_counter()
    m = load_model(None)
    convert_s = time.perf_counter() - t0
    c = m.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size) == ("llama", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_theta == 100000.0
    assert c.rms_norm_eps == 1e-5 and c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert m.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert len(m.weights) == 2 + 30 * 9
    assert m.tokenizer is not None and m.tokenizer.eos_token_ids == [2]

    t0 = time.perf_counter()
    again = load_model("smollm2-135m")
    load_s = time.perf_counter() - t0
    assert again.checksum == m.checksum
    assert load_s < convert_s
    print(f"\nconvert+load {convert_s:.2f} s, cached load {load_s:.2f} s")


@pytest.mark.slow
def test_embedded_default_generates_english():
    """Transformers on the converted folder: proves the name mapping and the q/k un-permutation."""
    folder = loader.ensure_converted(loader.default_gguf_path(), loader.DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = Tokenizer.from_dir(folder)
    ids = torch.tensor([tok.encode("Once upon a time, there was a little")])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :].tolist())
    assert text.startswith(" girl named"), text


_ANON_PEAK = """
import sys, threading, time
import torch
from workbench.models.loader import load_model

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon"))

peak, done = [0], []
def watch():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)

before = anon()
t = threading.Thread(target=watch)
t.start()
loaded = load_model(sys.argv[1], torch.bfloat16)
done.append(1)
t.join()
print(peak[0] - before, sum(w.nbytes for w in loaded.weights.values()))
"""


def test_a_gguf_file_loads_without_every_weight_in_float32_at_once(tmp_path):
    """Each tensor is dequantised in float32 and cast before the next is read: the process's
    anonymous memory peaks near the model's bf16 size (all of them in float32 first, then cast,
    peaked at ~3x it: 365 MiB for 120 MiB of weights)."""
    import subprocess
    import sys

    from conftest import make_tiny_model, write_gguf

    if not Path("/proc/self/status").exists():
        pytest.skip("the process's memory is read from /proc/self/status (Linux)")
    dims = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8)
    model = make_tiny_model(tmp_path / "hf", "llama", seed=4, num_key_value_heads=4, **dims)
    file = write_gguf(tmp_path / "mid.gguf", model, "llama", tmp_path / "hf")
    r = subprocess.run([sys.executable, "-c", _ANON_PEAK, str(file)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    peak, weights = map(int, r.stdout.split())
    assert weights > 30 << 20 and peak < 1.5 * weights + (16 << 20), (peak, weights)
