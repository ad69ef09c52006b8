"""The simulator against the engine on this host: calibrate, then predict runs it did not see.

    python docs/probes/sim_accuracy.py [rounds]     # 3 rounds by default, ~3 minutes each here

Cases (the issue's): W64 (the bench's default workload, all at t=0) at max_num_seqs 64 and 16,
Poisson arrivals at three rates, and batching=static. Each case is measured with the workload
driver on an in-process LLM (as `workbench bench` does) and simulated with the same requests.

A shared host's speed drifts: identical runs a minute apart differ by up to 10% in tok/s and 20%
in TTFT here. So the probe runs in rounds, each a calibration followed by every case, and reports
two comparisons:
- pooled: one fit over all rounds' calibrations (`Simulator.pooled`) against the median of each
  case's measured runs, so both sides sample the host over the same minutes;
- median of fits: the median of each round's own prediction, against the same median;
- single: each round's own calibration against that round's measured run (one moment each).
Each case also checks the pooled fit against its own measured steps, by kind (prefill-carrying
steps; decodes of 1, 2-3, 4-7, 8-15, 16+ sequences): the mean of predicted / measured - 1, so a
miss can be told apart as the step cost's or the scheduling's.
"""

import json
import statistics
import sys
from collections import defaultdict

from workbench import LLM, Simulator
from workbench.bench.driver import run_workload
from workbench.bench.runner import warm_up_engine
from workbench.bench.stats import summarize
from workbench.bench.workload import make_workload
from workbench.sim.cost import shapes_from_timeline

KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")
TARGETS = {"output_tok_s": 0.10, "ttft_p50_ms": 0.10, "itl_p50_ms": 0.15}  # the bounds
CASES = [
    ("W64 max_num_seqs=64", {"num_requests": 64}, {"max_num_seqs": 64}),
    ("W64 max_num_seqs=16", {"num_requests": 64}, {"max_num_seqs": 16}),
    ("poisson 1 req/s", {"num_requests": 32, "arrival": "poisson", "rate": 1.0}, {}),
    ("poisson 2 req/s", {"num_requests": 32, "arrival": "poisson", "rate": 2.0}, {}),
    ("poisson 4 req/s", {"num_requests": 48, "arrival": "poisson", "rate": 4.0}, {}),
    ("W64 batching=static", {"num_requests": 64}, {"batching": "static"}),
]


def step_bias(cost, steps) -> dict:
    """Mean predicted / measured - 1 of the step periods, by kind of step."""
    errors = defaultdict(list)
    for shape, sec in zip(*steps):
        kind = "prefill" if shape.prefill_tokens else f"decode<{1 << shape.num_seqs.bit_length()}"
        errors[kind].append(cost(shape) / sec - 1)
    return {k: f"{sum(v) / len(v):+.1%} (n={len(v)})" for k, v in sorted(errors.items())}


def errors(predicted, measured) -> dict:
    return {k: round(predicted[k] / measured[k] - 1, 3) for k in KEYS}


def misses(rows) -> int:
    return sum(abs(r[k]) > TARGETS[k] for r in rows for k in KEYS)


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
llm = LLM()
warm_up_engine(llm, llm.engine.model_config.vocab_size)
base = llm.settings()
workloads = [make_workload(tokenizer=llm.tokenizer, seed=0, **wl) for _, wl, _ in CASES]
fits, measured, steps, single = [], defaultdict(list), defaultdict(list), []
for r in range(rounds):
    fits.append(Simulator.calibrate(llm))
    print(f"round {r}: calibration", json.dumps({k: fits[-1].calibration[k] for k in ("steps", "mape")}), flush=True)
    for (name, _, settings), w in zip(CASES, workloads):
        llm.configure(**{"max_num_seqs": base["max_num_seqs"], "batching": base["batching"], **settings})
        llm.reset_prefix_cache()
        cursor = llm.timeline(since=1 << 62).cursor
        records, start = run_workload(llm, w.requests)
        m = summarize(records, start)
        tl = llm.timeline(since=cursor)
        measured[name].append(m)
        steps[name].append(shapes_from_timeline(tl.steps, tl.requests))
        own = fits[-1].run(w, {**base, **settings}, record=False).summary()
        single.append({"round": r, "case": name, **errors(own, m)})
        print(
            json.dumps(
                {"round": r, "case": name, "measured": {k: round(m[k], 2) for k in KEYS}, "single_error": single[-1]}
            ),
            flush=True,
        )
llm.configure(**{k: base[k] for k in ("max_num_seqs", "batching")})

sim = Simulator.pooled(fits)
print("pooled calibration:", json.dumps(sim.calibration), flush=True)
pooled, median_of_fits = [], []
for (name, _, settings), w in zip(CASES, workloads):
    predicted = sim.run(w, {**base, **settings}, record=False).summary()
    median = {k: statistics.median(m[k] for m in measured[name]) for k in KEYS}
    spread = {k: round(max(m[k] for m in measured[name]) / min(m[k] for m in measured[name]) - 1, 3) for k in KEYS}
    pooled.append({"case": name, **errors(predicted, median)})
    each = [f.run(w, {**base, **settings}, record=False).summary() for f in fits]
    median_of_fits.append({"case": name, **errors({k: statistics.median(e[k] for e in each) for k in KEYS}, median)})
    bias = {f"run {i}": step_bias(sim.cost, s) for i, s in enumerate(steps[name])}
    print(
        json.dumps(
            {
                "case": name,
                "predicted": {k: round(predicted[k], 2) for k in KEYS},
                "measured_median": {k: round(v, 2) for k, v in median.items()},
                "measured_spread": spread,
                "error": pooled[-1],
                "median_of_fits_error": median_of_fits[-1],
                "step_cost_bias": bias,
            }
        ),
        flush=True,
    )
print(f"pooled fit vs median of {rounds} runs: {misses(pooled)} misses of {len(pooled) * len(KEYS)}")
print(
    f"median of the rounds' predictions vs median of {rounds} runs: {misses(median_of_fits)} misses of "
    f"{len(median_of_fits) * len(KEYS)}"
)
print(f"each round's fit vs its own run: {misses(single)} misses of {len(single) * len(KEYS)}")
