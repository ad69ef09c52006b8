"""The human-readable form of a `run_bench` report."""

from __future__ import annotations


def _ms(x: float) -> str:
    return f"{x / 1e3:.1f} s" if x >= 10_000 else f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}"


def _bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def single_stream_line(name: str, r: dict) -> str:
    """gpt-fast style: tok/s, achieved GB/s and the fraction of the measured bandwidth."""
    if "achieved_gb_s" not in r:  # a peer serving other weights (llama.cpp's GGUF)
        return f"{name}: {r['decode_tok_s']:.1f} tok/s decode ({r['output_tok_s']:.1f} end to end)"
    segments = len(r.get("bandwidth_fraction_segments") or ()) or 1
    return (
        f"{name}: {r['decode_tok_s']:.1f} tok/s decode ({r['output_tok_s']:.1f} end to end), "
        f"{_num(r['achieved_gb_s'])} GB/s achieved, {100 * r['bandwidth_fraction']:.1f}% of the "
        f"{_num(r['bandwidth_gb_s'])} GB/s measured around it (median over {segments} segment(s); "
        f"limit {_num(r['decode_limit_tok_s'])} tok/s; "
        f"{100 * r['bandwidth_fraction_of_roofline']:.1f}% of the roofline's)"
    )


def breakdown_line(name: str, b: dict) -> str:
    """ "workbench: 412 steps; layers 71%, lm_head 12%, ...; 3% of the time between steps"."""
    shares = sorted(((k, v) for k, v in b["parts_share"].items() if v >= 0.005), key=lambda kv: -kv[1])
    return (
        f"{name}: {b['steps']} steps, {b['step_ms'] / 1e3:.1f} s; "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares)
        + f"; {100 * b['between_steps_share']:.0f}% of the time between steps"
    )


def arrival_text(w: dict) -> str:
    """A workload's arrivals in words ("all at t=0", "Poisson, 2.0 req/s")."""
    if w["arrival"] == "all":
        return "all at t=0"
    return f"{'Poisson' if w['arrival'] == 'poisson' else 'bursty'}, {w['rate']} req/s"


def format_report(rep: dict) -> str:
    w, roof = rep["workload"], rep["roofline"]
    arrival = arrival_text(w)
    m = rep["machine"]
    lines = [
        f"workbench bench: {rep['model']}, {w['num_requests']} requests ({arrival}), "
        f"{w['prompt_tokens']:,} prompt + {w['output_tokens']:,} output tokens "
        f"({w['source']} prompts, seed {w['seed']})",
        f"machine: {m['cpu']}, {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads)"
        + (f", load avg {rep['loadavg_start']} -> {rep['loadavg_end']}" if rep.get("loadavg_start") else ""),
        f"roofline: {roof['memory_bandwidth_gb_s']:.1f} GB/s read, {roof['peak_gflop_s']:.0f} GFLOP/s "
        f"{roof['compute_dtype']} peak ("
        + ", ".join(f"{k}: {_num(v)}" for k, v in roof["matmul_gflop_s"].items())
        + ")",
        f"  weights {_bytes(roof['weight_bytes'])} per decode step -> decode limit "
        f"{_num(roof['decode_limit_tok_s'])} tok/s per stream; {_num(roof['flop_per_token'] / 1e9)} GFLOP/token -> "
        f"compute limit {_num(roof['compute_limit_tok_s'])} tok/s",
    ]
    st = rep.get("engine_status") or {}
    if "kernel_variant" in st:
        lines.append(
            f"workbench kernels: {st['kernel_variant']} ({st['kernel_variant_reason']}); steps above a few "
            f"tokens multiply in {st['compute_path']} ({st['compute_path_reason']})"
        )
    if rep.get("hf_dtype"):
        lines.append(f"transformers peers in {rep['hf_dtype']} ({rep['hf_dtype_reason']})")
    if "workload" in roof:
        wl = roof["workload"]
        lines.append(
            f"  this workload: {_num(wl['tflop'])} TFLOP >= {_num(wl['min_seconds'])} s -> "
            f"at most {_num(wl['output_tok_s_limit'])} output tok/s"
        )
    lines.append("")
    header = (
        f"{'system':<26}{'out tok/s':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'ITL p50':>10}{'ITL p99':>10}{'roofline':>10}"
    )
    lines += [header, "-" * len(header)]
    for name, r in rep["results"].items():
        frac = r.get("roofline_fraction")
        lines.append(
            f"{name:<26}{r['output_tok_s']:>10.1f}{_ms(r['ttft_p50_ms']):>11}{_ms(r['ttft_p99_ms']):>11}"
            f"{_ms(r['itl_p50_ms']):>10}{_ms(r['itl_p99_ms']):>10}"
            + (f"{100 * frac:>9.1f}%" if frac is not None else f"{'':>10}")
        )
    lines.append(
        "(roofline: throughput vs this workload's compute limit; single streams: decode vs the bandwidth limit)"
    )
    lines.append("")
    for name, r in rep["results"].items():
        if name.endswith("single_stream"):
            lines.append(single_stream_line(name, r))
    for name, r in rep["results"].items():
        if r.get("step_breakdown"):
            lines.append(breakdown_line(name, r["step_breakdown"]))
    for key, v in rep.get("ratios", {}).items():
        lines.append(f"{key.replace('_vs_', ' / ')}: {v:.2f}x")
    for t in rep.get("targets", []):
        lines.append(
            f"target {t['name']}: {t['value']:.2f} (target >= {t['target']:g}): {'MET' if t['met'] else 'NOT MET'}"
        )
    lines += rep.get("notes", [])
    for peer, a in rep.get("token_agreement", {}).items():
        lines.append(
            f"greedy tokens vs {peer}: {a['identical_requests']}/{a['requests']} requests identical, "
            f"{100 * a['common_prefix_token_fraction']:.0f}% of tokens before the first difference"
        )
    return "\n".join(lines)
