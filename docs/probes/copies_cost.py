"""What serving without the kernels' copies of the weights costs (`models.host_memory`): two engines
in one process, one free to make its copies and one in a `host_memory_mb` that holds only its
weights and KV cache, their requests interleaved so the host's drift cancels: a prompt's TTFT and
single-stream decode (medians over the rounds). WORKBENCH_CPU_GEMM=tiles|bf16|fp32 forces the
large-step path, WORKBENCH_CPU_AMX=0 a host without AMX.

    WORKBENCH_CPU_AMX=0 WORKBENCH_CPU_GEMM=bf16 python docs/probes/copies_cost.py [--model shape:llama3.2-1b]
"""

import argparse
import statistics

from workbench import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shape:llama3.2-1b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=1024)
    args = ap.parse_args()
    free = LLM(model=args.model)
    held = free.status()["memory_mb"]
    tight = LLM(model=args.model, host_memory_mb=int(held["weights"] + held["kv_cache"]) + 8)
    engines = {"copies": free, "no copies": tight}
    greedy = dict(temperature=0, ignore_eos=True)
    ttft, tok_s = ({n: [] for n in engines} for _ in range(2))
    for r in range(args.rounds):
        for name, llm in sorted(engines.items(), reverse=r % 2 == 1):  # each first in every other round
            out = llm.generate(
                prompt_token_ids=[[17 + r] * args.prompt], params=SamplingParams(max_tokens=24, **greedy)
            )[0]
            ttft[name].append(out.metrics.ttft)
            tok_s[name].append(1 / statistics.median(out.metrics.itl))
    for name, llm in engines.items():
        st = llm.status()
        print(
            f"{name}: {args.prompt}-token TTFT {statistics.median(ttft[name]) * 1e3:.0f} ms; decode "
            f"{statistics.median(tok_s[name]):.1f} tok/s; memory_mb {st['memory_mb']}; "
            f"skipped {st['host_memory']['copies_skipped']}"
        )


if __name__ == "__main__":
    main()
