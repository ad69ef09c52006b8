"""A model whose kernels' copies do not fit beside it (`models.host_memory`): load it, serve a long
prompt and a decode, and say what the engine holds, what it did not copy, and how fast it went. Run
with WORKBENCH_CPU_AMX=0 on an AMX host to see a host without AMX (whose tiles or oneDNN keep a copy
of the weights beside them), WORKBENCH_CPU_GEMM=tiles|bf16|fp32 to force a large-step path.

    WORKBENCH_CPU_AMX=0 python docs/probes/host_memory.py --model shape:llama3-8b [--host-memory-mb N]
"""

import argparse
import resource
import statistics
import time

from workbench import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shape:llama3-8b")
    ap.add_argument("--host-memory-mb", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=700)
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, host_memory_mb=args.host_memory_mb)
    load_s = time.perf_counter() - t0
    st = llm.status()
    print(f"loaded in {load_s:.0f} s; memory_mb {st['memory_mb']}")
    print(f"compute path {st['compute_path']}: {st['compute_path_reason']}")
    greedy = dict(temperature=0, ignore_eos=True)
    for r in range(2):  # the first prompt makes whatever copies it may
        out = llm.generate(prompt_token_ids=[[17 + r] * args.prompt], params=SamplingParams(max_tokens=16, **greedy))[0]
        print(
            f"round {r}: {args.prompt}-token TTFT {out.metrics.ttft:.2f} s; "
            f"decode {1 / statistics.median(out.metrics.itl):.2f} tok/s"
        )
    st = llm.status()
    print(f"memory_mb {st['memory_mb']}")
    print(f"host_memory {st['host_memory']}")
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
