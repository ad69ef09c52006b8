"""The bf16 GEMVs' register width, A/B in one process (issue 27: why a Zen 4 streams slower than
a Zen 5): the engine's single stream (128 greedy tokens of the embedded model, bf16) with the GEMVs
in zmm and in ymm registers, interleaved over rounds, each beside the read bandwidth measured
around it (torch sum over 256 MiB, best of 3 before and after, as the bench does).

    python docs/probes/gemv_width.py [--rounds 4]
"""

import argparse
import statistics
import time

import torch
from workbench_kernels import cpu

from workbench import LLM, SamplingParams
from workbench.bench.runner import bandwidth_around
from workbench.runs import machine_facts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    print(machine_facts()["cpu"], "| measured width choice:", cpu.gemv_width()[1])
    llm = LLM()
    weight_bytes = sum(lin.weight.numel() * 2 for lin in llm.engine.runner.model.linears())
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompt = llm.tokenizer.encode("Once upon a time, there was a little")
    llm.generate(prompt_token_ids=[prompt], params=params)  # warm-up
    seen: dict[str, list[float]] = {w: [] for w in cpu.GEMV_WIDTHS}
    for rnd in range(args.rounds):
        order = cpu.GEMV_WIDTHS if rnd % 2 == 0 else cpu.GEMV_WIDTHS[::-1]
        for width in order:
            cpu.set_gemv_width(width)
            outs, bw = bandwidth_around(lambda: llm.generate(prompt_token_ids=[prompt], params=params), "cpu")
            itl = statistics.median(outs[0].metrics.itl)
            frac = weight_bytes / itl / 1e9 / bw
            seen[width].append(frac)
            print(
                f"round {rnd} {width}: ITL p50 {itl * 1e3:.2f} ms = {1 / itl:.0f} tok/s, "
                f"{weight_bytes / itl / 1e9:.1f} GB/s of weights; bandwidth around it {bw:.1f} GB/s -> {frac:.0%}"
            )
            time.sleep(0.5)
    for width, fr in seen.items():
        print(f"{width}: median {statistics.median(fr):.0%} of the bandwidth around it")
    cpu.set_gemv_width(None)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
