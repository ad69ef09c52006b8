"""Time of the engine's _postprocess (sampling, scheduler update, detokenizing) beside the forward,
per step, at 64 greedy requests (edit `p` for sampled ones).

    python docs/probes/postprocess_time.py LABEL
"""

import statistics
import sys
import time

from workbench import LLM, SamplingParams

llm = LLM()
eng = llm.engine
acc = {"post": [], "fwd": []}
orig_post, orig_fwd = eng._postprocess, eng.runner.forward


def post(*a, **k):
    t = time.perf_counter()
    r = orig_post(*a, **k)
    acc["post"].append(time.perf_counter() - t)
    return r


def fwd(*a, **k):
    t = time.perf_counter()
    r = orig_fwd(*a, **k)
    acc["fwd"].append(time.perf_counter() - t)
    return r


eng._postprocess, eng.runner.forward = post, fwd
p = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
prompts = [f"Story number {i}: once upon a time" for i in range(64)]
for _ in range(2):
    acc["post"].clear()
    acc["fwd"].clear()
    llm.generate(prompts, p)
    print(
        sys.argv[1],
        f"postprocess p50 {statistics.median(acc['post']) * 1e3:.3f} ms ",
        f"forward p50 {statistics.median(acc['fwd']) * 1e3:.1f} ms",
    )
