"""Single-stream decode: our engine's int4 (and bf16) against llama.cpp's tg128 on the embedded
model's own GGUF (Q4_1), interleaved round by round (this host's speed moves by 2x within
minutes: only ratios within a round compare).

    python docs/probes/int4_vs_llama.py LLAMA_BENCH [--rounds 5]

LLAMA_BENCH: llama.cpp's llama-bench binary (built from the llama-cpp-python sdist, FIELD-NOTES).
Ours: an in-process LLM per mode, 128 tokens after a 4-token prompt (as tg128), decode tok/s from
the token times, best of 3; llama-bench -t 2 -p 0 -n 128 -r 3.
"""

import argparse
import json
import statistics
import subprocess
import sys

from workbench import LLM, SamplingParams
from workbench.models.loader import default_gguf_path


def ours(llm) -> float:
    p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    best = 0.0
    for i in range(3):
        t = llm.generate(prompt_token_ids=[[5 + i, 6, 7, 8]], params=p)[0].metrics.token_times
        best = max(best, (len(t) - 1) / (t[-1] - t[0]))
    return best


def llama(binary: str, gguf: str) -> float:
    out = subprocess.run(
        [binary, "-m", gguf, "-t", "2", "-p", "0", "-n", "128", "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("llama_bench")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gguf = str(default_gguf_path())
    engines = {mode: LLM(quantization=mode) for mode in ("int4", "none")}
    for llm in engines.values():
        ours(llm)  # warm up
    ratios = {m: [] for m in engines}
    for rnd in range(args.rounds):
        ref = llama(args.llama_bench, gguf)
        row = {m: ours(llm) for m, llm in engines.items()}
        ref = (ref + llama(args.llama_bench, gguf)) / 2  # around ours
        for m, v in row.items():
            ratios[m].append(v / ref)
        print(
            f"round {rnd}: llama.cpp tg128 {ref:.1f} tok/s; ours int4 {row['int4']:.1f} ({row['int4'] / ref:.2f}x), "
            f"bf16 {row['none']:.1f} ({row['none'] / ref:.2f}x)",
            flush=True,
        )
    print("median ratio to llama.cpp: " + ", ".join(f"{m} {statistics.median(v):.2f}x" for m, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
