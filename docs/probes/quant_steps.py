"""int8 and int4 engines on MODEL (one after the other): batches of 16 and 32 requests' ITL and lone
prompts of 256 and 1,024 tokens' TTFT (distinct prompts), medians over ROUNDS. Alternate two builds
run by run (`docs/probes/ab_bench.sh` shows the worktree symlink swap):

    ROUNDS=2 MODES=int8,int4 python docs/probes/quant_steps.py [MODEL]
"""

import os
import statistics
import sys

from workbench import LLM, SamplingParams


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else None
    g = dict(temperature=0, ignore_eos=True)
    out = []
    for mode in os.environ.get("MODES", "int8,int4").split(","):
        llm = LLM(model=model, quantization=mode)
        llm.generate(prompt_token_ids=[[3] * 300], params=SamplingParams(max_tokens=2, **g))  # warm
        res: dict[str, list[float]] = {}
        for r in range(int(os.environ.get("ROUNDS", 2))):
            for b in (16, 32):
                outs = llm.generate(
                    prompt_token_ids=[[1000 + 100 * r + i] * 16 for i in range(b)],
                    params=SamplingParams(max_tokens=10, **g),
                )
                res.setdefault(f"W{b}", []).append(1e3 * statistics.median(t for o in outs for t in o.metrics.itl))
            for j, n in enumerate((256, 1024)):
                o = llm.generate(prompt_token_ids=[[5000 + 10 * r + j] * n], params=SamplingParams(max_tokens=1, **g))[
                    0
                ]
                res.setdefault(f"TTFT{n}", []).append(1e3 * o.metrics.ttft)
        out.append(f"{mode}: " + " ".join(f"{k} {statistics.median(v):.0f} ms" for k, v in res.items()))
        del llm
    print(" | ".join(out))


if __name__ == "__main__":
    main()
