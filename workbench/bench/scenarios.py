"""What each optimisation buys, measured: one scenario per toggle, on and off in one process run.

- `prefix`: 90% of every prompt is one shared system prompt; requests arrive one after another
  (each to an idle engine), so TTFT is the prefill the cache saves. Target: p50 TTFT >= 3x lower.
- `quant`: single-stream decode tok/s with bf16, int8 and int4 weights. Targets: int4 >= 2x,
  int8 >= 1.5x the bf16 rate.
- `spec`: an input-grounded task (repeat a paragraph with its typos fixed), single stream, with
  speculation off, `ngram` and `draft`; the peer is transformers' prompt-lookup decoding on the
  same weights and prompt. Target: ngram >= 1.5x off.
Every scenario returns plain JSON-ready dicts; `workbench bench --scenario NAME` prints them.
"""

from __future__ import annotations

import time
from typing import Any

from .stats import percentile
from .workload import BenchRequest, Workload, text_token_ids

SCENARIOS = ("prefix", "quant", "spec")
TARGETS = {"prefix_ttft_ratio": 3.0, "int4_vs_bf16": 2.0, "int8_vs_bf16": 1.5, "ngram_vs_off": 1.5}

SPEC_TEXT = (
    "The lighthouse keeper climbs the hundred and twelve steps of the tower every morning with a lamp "
    "in one hand and a cloth in the other, because the great lens gathers salt the way a window gathers "
    "frost. He has done this for ninteen winters, and he knows which steps creak and which ones ring. "
    "In the evening he writes the weather in a ledger that his grandfather started, in the same brown "
    "ink, and he never skips a day, not even when the storm takes the telephone line down."
)


def _serve_one(engine, request: BenchRequest) -> Any:
    """Release one request to an idle engine; return its record."""
    from .runner import run_engine

    records, _ = run_engine(engine, Workload([request], seed=0))
    return records[0]


def prefix_scenario(engine, *, num_requests: int = 12, prompt_len: int = 512, shared_fraction: float = 0.9,
                    output_len: int = 8) -> dict:
    tokens = text_token_ids(engine.tokenizer)
    shared = int(prompt_len * shared_fraction)
    system = tokens[:shared]
    unique = prompt_len - shared
    requests = [
        BenchRequest(i, system + tokens[shared + 1000 + i * unique: shared + 1000 + (i + 1) * unique], output_len)
        for i in range(num_requests)
    ]
    out: dict[str, Any] = {"workload": {"requests": num_requests, "prompt_len": prompt_len,
                                        "shared_prefix_tokens": shared, "output_len": output_len}}
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


def _single_stream(engine, request: BenchRequest) -> dict:
    record = _serve_one(engine, request)
    times = record.token_times
    return {
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
        "end_to_end_tok_s": len(times) / (times[-1] - record.arrival),
        "ttft_ms": record.ttft * 1e3,
        "tokens": len(times),
    }


def quant_scenario(engine, *, output_len: int = 128, weight_bytes: dict[str, float] | None = None) -> dict:
    tokens = text_token_ids(engine.tokenizer)
    request = BenchRequest(0, tokens[:32], output_len)
    out: dict[str, Any] = {}
    for mode in ("none", "int8", "int4"):
        engine.configure(quantization=mode)
        _serve_one(engine, BenchRequest(-1, tokens[:8], 4))  # warm the new layout
        out[mode] = _single_stream(engine, request)
    engine.configure(quantization="none")
    base = out["none"]["decode_tok_s"]
    out["int8_vs_bf16"] = out["int8"]["decode_tok_s"] / base
    out["int4_vs_bf16"] = out["int4"]["decode_tok_s"] / base
    out["targets"] = {"int8_vs_bf16": TARGETS["int8_vs_bf16"], "int4_vs_bf16": TARGETS["int4_vs_bf16"]}
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
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_len,
                                 do_sample=False, **extra)
            elapsed = time.monotonic() - start
        n = out.shape[1] - len(ids)
        res[name] = {"end_to_end_tok_s": n / elapsed, "tokens": n}
    res["prompt_lookup_vs_off"] = res["prompt_lookup"]["end_to_end_tok_s"] / res["off"]["end_to_end_tok_s"]
    return res


def run_scenarios(names, model=None, *, with_peers: bool = True, **settings) -> dict:
    """Run the named scenarios on one engine in this process; returns {name: result}."""
    from ..engine.llm_engine import LLMEngine
    from .peers import load_hf_model

    for name in names:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    engine = LLMEngine(model, **settings)
    out: dict[str, Any] = {"model": engine.model_name, "settings": engine.settings.as_dict()}
    for name in names:
        if name == "prefix":
            out[name] = prefix_scenario(engine)
        elif name == "quant":
            out[name] = quant_scenario(engine)
        else:
            hf = load_hf_model(engine.model_config.path, engine.dtype) if with_peers else None
            out[name] = spec_scenario(engine, hf_model=hf)
    return out


__all__ = ["SCENARIOS", "run_scenarios", "prefix_scenario", "quant_scenario", "spec_scenario"]
