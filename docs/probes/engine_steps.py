"""One engine on MODEL, a few rounds of: a single stream's decode tok/s, batches of 8 and 32 requests'
ITL, and lone prompts of 128, 480 and 1,536 tokens' TTFT (each prompt distinct: no prefix hits;
`max_num_batched_tokens=2048`, so the longest is one step); medians, and `status()["memory_mb"]`.
Alternate two builds run by run (`docs/probes/ab_bench.sh` shows the worktree symlink swap):

    ROUNDS=3 python docs/probes/engine_steps.py [MODEL]
"""

import os
import statistics
import sys

from workbench import LLM, SamplingParams


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None, max_num_batched_tokens=2048)
    g = dict(temperature=0, ignore_eos=True)
    res: dict[str, list[float]] = {}
    llm.generate(prompt_token_ids=[[3] * 700], params=SamplingParams(max_tokens=2, **g))  # warm
    for r in range(int(os.environ.get("ROUNDS", 3))):
        one = llm.generate(prompt_token_ids=[[300 + r] * 16], params=SamplingParams(max_tokens=32, **g))[0]
        res.setdefault("single tok/s", []).append(1 / statistics.median(one.metrics.itl))
        for b in (8, 32):
            outs = llm.generate(
                prompt_token_ids=[[1000 + 100 * r + i] * 16 for i in range(b)],
                params=SamplingParams(max_tokens=12, **g),
            )
            res.setdefault(f"W{b} ITL ms", []).append(1e3 * statistics.median(t for o in outs for t in o.metrics.itl))
        for j, n in enumerate((128, 480, 1536)):
            o = llm.generate(prompt_token_ids=[[5000 + 10 * r + j] * n], params=SamplingParams(max_tokens=1, **g))[0]
            res.setdefault(f"TTFT{n} ms", []).append(1e3 * o.metrics.ttft)
    print(" | ".join(f"{k} {statistics.median(v):.1f}" for k, v in res.items()), "|", llm.engine.status()["memory_mb"])


if __name__ == "__main__":
    main()
