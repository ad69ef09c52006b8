"""On AMX: prompts' steps on our tiles against oneDNN's packed kernels, in the engine (in process, the
embedded SmolLM2 in bf16), interleaved in one process so the host's drift cancels: the time of a
lone prompt of N tokens (max_tokens=1) with every step on the tiles (`AMX_TILES_MAX_ROWS` set out
of reach) and with steps above the threshold on oneDNN; then a W64 burst each way.

    python docs/probes/amx_prompt_rows.py [--rows 384,640,1024,2048] [--threshold 512] [--w64 3]
        [--baseline ROWS]  (the other way's threshold instead of every step on the tiles)
        [--model MODEL]
"""

import argparse
import random
import statistics
import time

from workbench_kernels import cpu

from workbench import LLM, SamplingParams
from workbench.bench.driver import run_workload
from workbench.bench.stats import summarize
from workbench.bench.workload import make_workload

ALL_TILES = 1 << 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="384,640,1024,2048")
    ap.add_argument("--threshold", type=int, default=cpu.AMX_TILES_MAX_ROWS)
    ap.add_argument("--baseline", type=int, default=ALL_TILES)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--w64", type=int, default=3, help="W64 rounds each way (0: none)")
    args = ap.parse_args()
    if not cpu.amx()[0]:
        raise SystemExit(f"no AMX path here: {cpu.amx()[1]}")
    llm = LLM(args.model)
    one = SamplingParams(max_tokens=1, temperature=0)
    base = "tiles" if args.baseline == ALL_TILES else f"oneDNN above {args.baseline}"
    ways = {base: args.baseline, f"oneDNN above {args.threshold}": args.threshold}
    for cap in ways.values():  # both weight layouts packed before timing
        cpu.AMX_TILES_MAX_ROWS = cap
        llm.generate(prompt_token_ids=[[5] * 1024], params=one)
    rng = random.Random(0)
    for n in map(int, args.rows.split(",")):
        times = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, cap in ways.items():
                cpu.AMX_TILES_MAX_ROWS = cap
                ids = [rng.randrange(100, 40000) for _ in range(n)]
                t = time.perf_counter()
                llm.generate(prompt_token_ids=[ids], params=one)
                times[name].append(time.perf_counter() - t)
        a, b = (statistics.median(v) for v in times.values())
        print(
            f"{n:5d} tokens: "
            + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in times.items())
            + f"; ratio {a / b:.2f}",
            flush=True,
        )
    vocab = llm.engine.model_config.vocab_size
    runs = {name: [] for name in ways}
    for rnd in range(args.w64):
        for name, cap in ways.items():
            cpu.AMX_TILES_MAX_ROWS = cap
            llm.reset_prefix_cache()
            records, start = run_workload(llm, make_workload(64, seed=rnd, vocab_size=vocab).requests)
            runs[name].append(summarize(records, start))
    for name, ms in runs.items():
        if ms:
            keys = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")
            print(f"W64 {name}: " + ", ".join(f"{k} {statistics.median(m[k] for m in ms):.1f}" for k in keys))


if __name__ == "__main__":
    main()
