"""The report of `workbench gpucheck` (`workbench/bench/gpucheck.py`): its targets, the markdown summary
written beside the JSON, and the writing of both (after every section, so a run cut off keeps
its part)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .report import breakdown_line

TARGETS = {
    "decode_attention_fraction": 0.75,  # issue 50.3: every shape, 64 x 4k and 1 x 32k alike
    "prefill_vs_sdpa": 1.0,
    "engine_vs_transformers_w64": 5.0,
    "engine_vs_transformers_w64_cuda_graphs": 5.0,
    "engine_vs_transformers_batch256": 5.0,  # issue 50.5: 256 requests in one batch each, graphs on
    "engine_vs_transformers_w64_compiled": 5.0,  # transformers' forward compiled (where it compiled)
    "engine_single_stream_vs_transformers": 5.0,
    "cuda_graphs_single_stream": 3.0,
    "eager_layer_cost_vs_first_run": 3.0,  # issue 50.5: an eager single-stream step's time per layer, 3x less
    "device_busy_w64_async": 0.95,
}
# at most (the others: at least)
CEILINGS = {"launches_per_layer": 12, "ttft_over_compute_limit": 1.5}
DEFAULT_OUTPUT = Path("docs") / "gpu" / "gpucheck.json"
# the first GPU run's eager single stream (H200, 2026-12-04, SmolLM2's shape, ~38 launches a layer):
# 51.67 tok/s over 30 layers, 0.645 ms a layer (docs/gpu/gpucheck.json)
FIRST_RUN_EAGER_LAYER_MS = 1e3 / 51.67 / 30


def decode_tok_s(engine: dict, run: str, system: str) -> float | None:
    """A run's decode tok/s of one system, if it ran."""
    return ((engine.get(run) or {}).get("results", {}).get(system) or {}).get("decode_tok_s")


def targets(rep: dict) -> list[dict]:
    out = []

    def add(name: str, value):
        if isinstance(value, (int, float)):
            out.append({"name": name, "value": value, "target": TARGETS[name], "met": value >= TARGETS[name]})

    decodes = [k["fraction"] for k in rep["kernels"] if k["name"].startswith("decode_attention") and "fraction" in k]
    prefills = [k["fraction"] for k in rep["kernels"] if k["name"].startswith("extend_attention") and "fraction" in k]
    add("decode_attention_fraction", min(decodes) if decodes else None)
    add("prefill_vs_sdpa", min(prefills) if prefills else None)
    eng = rep["engine"]
    add("engine_vs_transformers_w64", (eng.get("triton") or {}).get("ratios", {}).get("workbench_vs_hf_static"))
    # the same workload (one seed, one request count) in both runs: graphs' W64 over transformers' of the first
    graphs_w64 = ((eng.get("triton_cuda_graphs") or {}).get("results", {}).get("workbench") or {}).get("output_tok_s")
    hf_w64 = ((eng.get("triton") or {}).get("results", {}).get("hf_static") or {}).get("output_tok_s")
    add("engine_vs_transformers_w64_cuda_graphs", graphs_w64 / hf_w64 if graphs_w64 and hf_w64 else None)
    add("engine_vs_transformers_batch256", (eng.get("batch256") or {}).get("ratios", {}).get("workbench_vs_hf_static"))
    compiled = eng.get("hf_compiled") or {}
    hf_compiled = ((compiled.get("results") or {}).get("hf_static") or {}).get("output_tok_s")
    if (compiled.get("hf_static") or {}).get("frames_compiled"):  # else nothing compiled: no such baseline
        add("engine_vs_transformers_w64_compiled", graphs_w64 / hf_compiled if graphs_w64 and hf_compiled else None)
    ours = decode_tok_s(eng, "triton_cuda_graphs", "workbench_single_stream") or decode_tok_s(
        eng, "triton", "workbench_single_stream"
    )
    theirs = decode_tok_s(eng, "hf_sequential", "hf_single_stream")
    add("engine_single_stream_vs_transformers", ours / theirs if ours and theirs else None)
    add("cuda_graphs_single_stream", rep["cuda_graphs"].get("speedup"))
    eager = decode_tok_s(eng, "triton", "workbench_single_stream")
    layers = ((eng.get("triton") or {}).get("engine_status") or {}).get("num_layers")
    add("eager_layer_cost_vs_first_run", FIRST_RUN_EAGER_LAYER_MS * eager * layers / 1e3 if eager and layers else None)
    add("device_busy_w64_async", (rep.get("async_scheduling") or {}).get("w64_device_busy_on"))
    for name, value in (
        ("launches_per_layer", rep.get("launches_per_layer")),
        ("ttft_over_compute_limit", (rep.get("ttft") or {}).get("over_limit")),
    ):
        if isinstance(value, (int, float)):
            cap = CEILINGS[name]
            out.append({"name": name, "value": value, "target": cap, "met": value <= cap, "at_most": True})
    return out


def _breakdown_lines(rep: dict) -> list[str]:
    """Each engine run's step breakdown (where its steps' time went), the eager run's with the
    kernel launches a layer that `launches` counted (issue 50.2: a launch-bound step shows both)."""
    out = []
    for name, run in rep["engine"].items():
        for sysname, r in ((run.get("results") or {}) if isinstance(run, dict) else {}).items():
            b = r.get("step_breakdown")
            if not b:
                continue
            line = "- step breakdown, " + breakdown_line(f"{name} / {sysname}", b)
            if b.get("device_busy_share") is not None:
                line += f"; device busy {b['device_busy_share']:.1%}"
            if name == "triton" and rep.get("launches_per_layer") is not None:
                line += f"; {rep['launches_per_layer']:g} kernel launches a layer (eager decode, `launches`)"
            out.append(line)
    return out


def summary_markdown(rep: dict) -> str:
    """The short summary written beside the JSON (of a whole run or of one cut off part way)."""
    dev = rep["device"]
    lim = rep.get("limits") or {}
    lines = [
        f"# workbench gpucheck{' (dry run)' if rep['dry_run'] else ''}: {dev['name']}",
        "",
        f"torch {dev['torch']}, Triton {dev['triton']}; started {rep['started_at']}, took "
        f"{rep.get('duration_s', 0):.0f} s. Limits: copy {lim.get('copy_GBps', 0):.0f} GB/s (read + write), "
        f"bf16 matmul {lim.get('matmul_TFLOPs', 0):.1f} TFLOP/s ({lim.get('matmul_n')}^3).",
        "",
        "Sections (s): " + ", ".join(f"{k} {v:g}" for k, v in rep.get("sections_s", {}).items()),
    ]
    lines += [f"- skipped {s}" for s in rep.get("skipped", [])]
    lines += [f"- FAILED {name}: {err[:300]}" for name, err in rep.get("errors", {}).items()]
    lines += ["", "| kernel | max abs err | GB/s | fraction |", "|---|---|---|---|"]
    for k in rep["kernels"]:
        if "error" in k:
            lines.append(f"| {k['name']} | FAILED: {k['error'][:120]} | | |")
            continue
        of = " of SDPA" if k.get("fraction_of") else " of copy"
        lines.append(f"| {k['name']} | {k['max_abs_err']:.3g} | {k['gb_s']:.3g} | {k['fraction']:.3g}{of} |")
    eng = rep["engine"]
    lines += ["", f"Engine ({eng.get('model', 'not run')}):", ""]
    for name in (
        "triton",
        "triton_cuda_graphs",
        "triton_async",
        "hf_sequential",
        "batch256",
        "hf_compiled",
        "torch_ops",
    ):
        for sysname, s in ((eng.get(name) or {}).get("results") or {}).items():
            extra = f", decode {s['decode_tok_s']:.1f} tok/s" if "decode_tok_s" in s else ""
            lines.append(
                f"- {name} / {sysname}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                f"ITL p50 {s['itl_p50_ms']:.1f} ms{extra}"
            )
    lines += _breakdown_lines(rep)
    for name, run in eng.items():
        hf = isinstance(run, dict) and run.get("hf_static")
        if hf:
            lines.append(
                f"- {name} / hf_static: transformers in padded batches of {hf['batch_size']}, {hf['cache']} KV "
                f"cache, compile {'asked' if hf['compile_asked'] else 'off'}, {hf['frames_compiled']} frames compiled"
            )
    for name, x in (eng.get("exactness") or {}).items():
        lines.append(
            f"- exactness ({name}): {x['identical_requests']}/{x['requests']} fp32 greedy requests equal "
            f"transformers'; seeded sampling repeatable: {x.get('sampled_repeatable')}; CUDA graph steps "
            f"{x['cuda_graph_steps']}"
        )
    n = rep.get("launches")
    if n:
        counts = n["counts"]
        serving = counts.get("fused", counts["unfused"])
        why = f"unfused {counts['unfused']['per_layer']:g}" if "fused" in counts else n["fused_layers_reason"]
        lines.append(
            f"- kernel launches per layer, eager decode of {n['batch']}: {n['launches_per_layer']:g} ({why}); "
            f"{serving['outside_layers']:g} outside the layers; counted: {n['counted']}"
        )
    g = rep["cuda_graphs"]
    if g.get("speedup"):
        lines.append(
            f"- CUDA graphs, single stream: {g['single_stream_tok_s_on']:.1f} vs "
            f"{g['single_stream_tok_s_off']:.1f} tok/s ({g['speedup']:.2f}x); steps {g['steps']}"
        )
    else:
        lines.append(f"- CUDA graphs: not measured ({g.get('last_eager_reason')})")
    t = rep.get("ttft")
    if t:
        lines.append(
            f"- TTFT of a {t['prompt_tokens']}-token prompt: {t['ttft_ms']:.1f} ms, {t['over_limit']:.2f}x its "
            f"compute limit ({t['limit_ms']:.1f} ms: {t['prefill_TFLOPs']:.2f} TFLOP at the measured rate; "
            f"{t['achieved_TFLOPs']:.1f} TFLOP/s achieved); prefill attention {t.get('prefill_attention')} "
            f"({t.get('prefill_attention_reason')}); TTFT by path (ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in (t.get("ttft_ms_by_path") or {}).items())
        )
    a = rep.get("async_scheduling") or {}
    if a.get("w64_tok_s_on"):

        def busy(x):
            return "n/a" if x is None else f"{x:.1%}"

        lines.append(
            f"- async scheduling (with graphs), W64: {a['w64_tok_s_on']:.1f} vs {a.get('w64_tok_s_off') or 0:.1f} "
            f"tok/s off; device busy {busy(a.get('w64_device_busy_on'))} vs {busy(a.get('w64_device_busy_off'))}; "
            f"single stream {a.get('single_stream_tok_s_on') or 0:.1f} vs "
            f"{a.get('single_stream_tok_s_off') or 0:.1f} tok/s"
        )
    if rep.get("sweep"):
        lines += ["", "| sweep | default us | fastest us | fastest config | configs |", "|---|---|---|---|---|"]
        for key, r in rep["sweep"].items():
            best = r["fastest"][0]
            cfg = {k: v for k, v in best.items() if k != "time_us"}
            lines.append(
                f"| {key} | {r['default']['time_us'] or 0:.1f} | {best['time_us']:.1f} | {cfg} | "
                f"{r['configs_timed']}{'' if r['complete'] else ' (budget)'} |"
            )
    if rep["targets"]:
        lines += ["", "| target | value | needed | met |", "|---|---|---|---|"]
        lines += [
            f"| {t['name']} | {t['value']:.2f} | {'<=' if t.get('at_most') else '>='} {t['target']:g} | "
            f"{'yes' if t['met'] else 'NO'} |"
            for t in rep["targets"]
        ]
    elif rep["dry_run"]:
        lines += ["", "Dry run: no speed targets."]
    return "\n".join(lines) + "\n"


def write_report(rep: dict, output: str | os.PathLike | None) -> tuple[Path, Path]:
    """The JSON at `output` (default docs/gpu/gpucheck.json; the dry run's gpucheck-dryrun.json) and
    its markdown summary beside it (same name, .md)."""
    path = (
        Path(output)
        if output
        else DEFAULT_OUTPUT.with_name("gpucheck-dryrun.json" if rep["dry_run"] else DEFAULT_OUTPUT.name)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=2, default=str) + "\n")
    md = path.with_suffix(".md")
    md.write_text(summary_markdown(rep))
    return path, md
