"""The engine's sections of `workbench gpucheck` (`bench/gpucheck.py`): the model the runs use,
one bench run on the device, exactness against transformers, kernel launches per layer, the
CUDA-graph and async-scheduling summaries, and one long prompt's TTFT against its compute limit."""

from __future__ import annotations

from pathlib import Path

from .gpu_report import decode_tok_s
from .workload import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN

# the dry run's model and the exactness check's: a tiny Llama
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def _random_llama(folder: Path, seed: int, **config):
    """A random Llama of `config` (tied embeddings, BOS 1, EOS 2), its 2-D weights scaled x4 for
    decisive logits, not near-ties (as the tests' models), saved to `folder`; returns it (CPU)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**config, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def model_folder(dry_run: bool, root: Path) -> tuple[str | None, str]:
    """(model for LLM / run_bench, what it is): the embedded model when installed; else random
    weights, SmolLM2's shape on a GPU, a tiny model in the dry run."""
    if not dry_run:
        try:
            import gguf  # noqa: F401 - reads the embedded model's file

            from ..models.loader import default_gguf_path

            default_gguf_path()
            return None, "the embedded SmolLM2-135M (bf16)"
        except (ImportError, FileNotFoundError):
            pass
    shape = (
        TINY
        if dry_run
        else dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
        )
    )
    folder = root / ("tiny" if dry_run else "smollm2-shape")
    _random_llama(folder, 0, **shape, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0)
    what = "a tiny random Llama (2 layers)" if dry_run else "random weights of SmolLM2-135M's shape"
    return str(folder), what


def engine_run(
    model: str | None,
    device,
    dry_run: bool,
    sizes: dict,
    log,
    *,
    systems: list[str],
    num_requests: int | None = None,
    attention_backend: str = "triton",
    cuda_graphs: bool = False,
    async_scheduling: bool = False,
    single_stream: bool = True,
    hf_compile: bool = False,
) -> dict:
    """One `run_bench` on this device: its results, ratios, token agreement and the engine's status
    fields that say what ran (backend, kernels, CUDA graphs). Every request runs at once: the engine
    takes them all in one batch, its KV cache sized to hold them at their longest (an 8B model's
    128 KiB a token would fill the default 512 MB with 4,096 tokens), and transformers' `hf_static`
    pads them into one batch too, its KV in the static cache (compiled where `hf_compile`)."""
    from .runner import run_bench

    n = num_requests or sizes["requests"]
    prompt_len, output_len = ((32, 128), (8, 16)) if dry_run else (DEFAULT_PROMPT_LEN, DEFAULT_OUTPUT_LEN)
    longest = prompt_len[1] + output_len[1]
    settings = {
        "device": str(device),
        "attention_backend": attention_backend,
        "max_num_seqs": n,
        "num_kv_blocks": n * -(-longest // 16) + 64,  # + the single stream's 320 tokens, and spare
    }
    if cuda_graphs:
        settings["cuda_graphs"] = True
    if async_scheduling:
        settings["async_scheduling"] = True
    rep = run_bench(
        model,
        systems=systems,
        settings=settings,
        num_requests=n,
        quick=dry_run,
        record=False,
        log=log,
        single_stream=single_stream,
        prompt_len=prompt_len,
        output_len=output_len,
        hf_batch_size=n,
        hf_cache="static",
        hf_compile=hf_compile and device.type == "cuda",
        **(dict(single_stream_tokens=16) if dry_run else {}),
    )
    return {
        "results": rep["results"],
        "ratios": rep.get("ratios", {}),
        "token_agreement": rep.get("token_agreement", {}),
        "hf_static": rep.get("hf_static"),
        "engine_status": {
            k: v
            for k, v in (rep.get("engine_status") or {}).items()
            if k.startswith(("attention", "kernel", "cuda_graph", "device", "dtype", "num_", "prefill"))
        },
    }


def launches(model: str | None, device, log) -> dict:
    """Kernel launches per decoder layer in an eager decode step of 4 sequences, with the fused
    layer ops and without (`bench/launches.py`)."""
    import torch

    from ..llm import LLM
    from .launches import launches_per_layer

    log("engine: kernel launches per layer (eager decode, torch profiler)")
    dtype = "float32" if device.type == "cpu" else "auto"  # the dry run's: its C kernels would take a bf16 step
    llm = LLM(model, device=str(device), dtype=dtype, attention_backend="triton", num_kv_blocks=64)
    try:
        return launches_per_layer(llm)
    finally:
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()


def graphs(engine: dict) -> dict:
    """The single stream with CUDA graphs on and off, and how many steps replayed."""
    off = decode_tok_s(engine, "triton", "workbench_single_stream")
    on = decode_tok_s(engine, "triton_cuda_graphs", "workbench_single_stream")
    status = (engine.get("triton_cuda_graphs") or {}).get("engine_status", {})
    replayed = (status.get("cuda_graph_steps") or {}).get("replayed", 0)
    return {
        "single_stream_tok_s_off": off,
        "single_stream_tok_s_on": on,
        # a speed-up only where graphs replayed (a CPU runs both eagerly: no speed-up to claim)
        "speedup": on / off if replayed and on and off else None,
        "buckets": status.get("cuda_graph_buckets"),
        "splits": status.get("cuda_graph_splits"),  # each bucket's split-KV count, fixed at capture
        "steps": status.get("cuda_graph_steps"),
        "last_eager_reason": status.get("cuda_graph_reason") if "triton_cuda_graphs" in engine else "not run",
    }


def ttft(model: str | None, device, dry_run: bool, sizes: dict, limits: dict, log) -> dict:
    """Time to first token of one prompt of `ttft_prompt` random token ids, prefilled in one step (no
    prefix cache, nothing else running), against its compute limit: the prompt's FLOPs
    (`scheduler.prefill_flops`) at the bf16 matmul rate measured first. Median of three, after a
    warm-up, on the prefill path `prefill_attention=auto` picks (status says which, from what
    times), then on each path forced."""
    import torch

    from ..engine.scheduler import prefill_flops
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    n = sizes["ttft_prompt"]
    log(f"engine: TTFT of a {n}-token prompt against the compute limit")
    dtype = "float32" if dry_run else "auto"
    llm = LLM(model, device=str(device), dtype=dtype, attention_backend="triton", max_num_batched_tokens=n,
              prefix_caching=False, num_kv_blocks=-(-n // 16) + 8)  # fmt: skip
    try:
        vocab = llm.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)

        def median_ttft(llm) -> tuple[float, list[float]]:
            times = []
            for _ in range(4):
                ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
                out = llm.generate(prompt_token_ids=[ids], params=SamplingParams(max_tokens=1, temperature=0))[0]
                times.append(out.metrics.ttft)
            return sorted(times[1:])[1], times  # the warm-up's left out

        ttft_s, times = median_ttft(llm)
        status = llm.status()
        by_path = {}
        for path in ("kernel", "sdpa"):
            llm.configure(prefill_attention=path)
            by_path[path] = median_ttft(llm)[0] * 1e3
        flops = prefill_flops(llm.engine.model_config, n)
        limit_s = flops / (limits["matmul_TFLOPs"] * 1e12)
        return {
            "prompt_tokens": n,
            "ttft_ms": ttft_s * 1e3,
            "ttfts_ms": [t * 1e3 for t in times],
            "prefill_TFLOPs": flops / 1e12,
            "limit_ms": limit_s * 1e3,
            "over_limit": ttft_s / limit_s,  # target <= 1.5 (issue 50.5)
            "achieved_TFLOPs": flops / ttft_s / 1e12,
            # issue 50.3: the path auto picked for this shape, from its measurement of both
            "prefill_attention": status["prefill_attention"],
            "prefill_attention_reason": status["prefill_attention_reason"],
            "ttft_ms_by_path": by_path,
        }
    finally:
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()


def overlap(engine: dict) -> dict:
    """Async scheduling against the same run without it (both with CUDA graphs): W64 and single-stream
    tok/s, and the share of device time busy with steps (on CUDA; None on a CPU: no device to idle)."""

    def result(run: str, system: str) -> dict:
        return ((engine.get(run) or {}).get("results") or {}).get(system) or {}

    out = {}
    for label, run in (("off", "triton_cuda_graphs"), ("on", "triton_async")):
        w64, single = result(run, "workbench"), result(run, "workbench_single_stream")
        out[f"w64_tok_s_{label}"] = w64.get("output_tok_s")
        out[f"single_stream_tok_s_{label}"] = single.get("decode_tok_s")
        out[f"w64_device_busy_{label}"] = (w64.get("step_breakdown") or {}).get("device_busy_share")
    return out


def exactness(device, dry_run: bool, root: Path, log) -> dict:
    """fp32 greedy tokens of the engine on this device (Triton kernels; CUDA graphs on, where they
    replay; and async scheduling) against transformers on the same random weights."""
    import torch

    from ..llm import LLM
    from ..sampling_params import SamplingParams

    log("engine: exactness against transformers (fp32 greedy)")
    folder = root / "exact"
    hf = _random_llama(folder, 1, **TINY, max_position_embeddings=512, rms_norm_eps=1e-6)
    hf = hf.to(device)
    prompts = [[3 + (i * 7 + j * 11) % 250 for j in range(n)] for i, n in enumerate((1, 5, 17, 33, 64))]
    new = 12
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            for _ in range(new):
                nxt = hf(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
            expected.append(ids[0, len(p) :].tolist())
    out, first_draws = {}, None
    for name, extra in (
        ("triton", {}),
        ("triton_cuda_graphs", {"cuda_graphs": True}),
        ("triton_async", {"cuda_graphs": True, "async_scheduling": True}),
        ("triton_sdpa_prefill", {"prefill_attention": "sdpa"}),
    ):
        llm = LLM(
            str(folder), dtype="float32", device=str(device), attention_backend="triton", num_kv_blocks=64, **extra
        )
        got = [
            o.token_ids
            for o in llm.generate(prompt_token_ids=prompts, params=SamplingParams(max_tokens=new, temperature=0))
        ]
        # seeded sampling on this device (the engine's draws come from CPU generators): twice, the same
        # tokens, all inside the vocabulary (greedy alone never reaches the sampler's search)
        sampled = SamplingParams(max_tokens=new, temperature=0.8, top_p=0.9, top_k=50, seed=7)
        draws = [[o.token_ids for o in llm.generate(prompt_token_ids=prompts, params=sampled)] for _ in range(2)]
        st = llm.status()
        out[name] = {
            "identical_requests": sum(a == b for a, b in zip(got, expected)),
            "requests": len(prompts),
            "sampled_repeatable": draws[0] == draws[1]
            and all(0 <= t < TINY["vocab_size"] for row in draws[0] for t in row)
            and all(len(row) == new for row in draws[0]),
            "cuda_graph_steps": st["cuda_graph_steps"],
            "cuda_graph_reason": st["cuda_graph_reason"],
            # the same seeded tokens as the first (synchronous, eager) engine's
            "sampled_as_first": first_draws is None or draws[0] == first_draws,
            "overlapped_steps": llm.metrics()["total_overlapped_steps"],
        }
        first_draws = first_draws or draws[0]
    return out
