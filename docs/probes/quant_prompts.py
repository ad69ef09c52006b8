"""Lone prompts in each quantisation mode, in one process, interleaved so the host's drift cancels:
bf16 against int8 and int4 with their large steps on the AMX tiles (`cpu.gemm_q8_tiles`,
`gemm_q4_tiles`) and on torch's weight-only kernels (`cpu.codes_on_tiles` turned off: the path
before). TTFT medians, ms.

    python docs/probes/quant_prompts.py [--model MODEL] [--rows 64,256,1024] [--reps 3]
"""

import argparse
import random
import statistics
import time

from workbench_kernels import cpu

from workbench import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model)
    one = SamplingParams(max_tokens=1, temperature=0)
    take = cpu.codes_on_tiles
    ways = {
        "bf16": ("none", take),
        "int8 tiles": ("int8", take),
        "int8 torch": ("int8", lambda rows, k: False),
        "int4 tiles": ("int4", take),
        "int4 torch": ("int4", lambda rows, k: False),
    }
    rng = random.Random(0)
    for n in map(int, args.rows.split(",")):
        times = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, (mode, rule) in ways.items():
                llm.configure(quantization=mode)
                cpu.codes_on_tiles = rule
                ids = [rng.randrange(100, 30000) for _ in range(n)]
                llm.generate(prompt_token_ids=[ids[:16]], params=one)  # a re-layout's first step apart
                t = time.perf_counter()
                llm.generate(prompt_token_ids=[ids], params=one)
                times[name].append(time.perf_counter() - t)
        cpu.codes_on_tiles = take
        print(
            f"{n:5d} tokens: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f}" for k, v in times.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
