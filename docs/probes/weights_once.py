"""One engine process per run: the bf16 layers' weights held once, in the tiles' layout (default), or
twice (WORKBENCH_CPU_WEIGHTS_ONCE=0: the plain copy for the GEMVs beside the tiles). Prints RSS after
load, status()'s memory_mb, single-stream decode tok/s, a batch of 8's ITL and a prompt's TTFT.
Alternate the two settings run by run so the host's drift cancels:

    for i in 1 2 3; do for once in 1 0; do
        WORKBENCH_CPU_WEIGHTS_ONCE=$once python docs/probes/weights_once.py shape:llama3.2-1b; done; done
"""

import os
import statistics
import sys

from workbench import LLM, SamplingParams


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
    rss = rss_mib()
    once = os.environ.get("WORKBENCH_CPU_WEIGHTS_ONCE", "1")
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[[7] * 16], params=SamplingParams(max_tokens=4, **greedy))  # warm
    single = llm.generate(prompt_token_ids=[[11] * 16], params=SamplingParams(max_tokens=48, **greedy))[0]
    tok_s = 1 / statistics.median(single.metrics.itl)
    batch = llm.generate(
        prompt_token_ids=[[13 + i] * 16 for i in range(8)], params=SamplingParams(max_tokens=24, **greedy)
    )
    itl8 = statistics.median(t for o in batch for t in o.metrics.itl) * 1e3
    ttft = {
        n: statistics.median(
            llm.generate(prompt_token_ids=[[17 + i] * n], params=SamplingParams(max_tokens=1, **greedy))[0].metrics.ttft
            for i in range(3)
        )
        for n in (512, 1536)
    }
    mem = llm.engine.status()["memory_mb"]
    print(
        f"once={once}: RSS {rss:,.0f} MiB after load; single {tok_s:.1f} tok/s; batch 8 ITL {itl8:.1f} ms; "
        f"TTFT 512 / 1536 tokens {ttft[512] * 1e3:.0f} / {ttft[1536] * 1e3:.0f} ms; memory_mb {mem}"
    )


if __name__ == "__main__":
    main()
