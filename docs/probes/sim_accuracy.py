"""The simulator against the engine on this host: calibrate once, then predict runs it did not see.

    python docs/probes/sim_accuracy.py            # prints one line per case and the errors

Cases (the issue's): W64 (the bench's default workload, all at t=0) at max_num_seqs 64 and 16,
Poisson arrivals at three rates, and batching=static. Each case is measured with the workload
driver on an in-process LLM (as `workbench bench` does) and simulated with the same requests.
Each case also checks the fit against that run's own measured steps, by kind (prefill-carrying
steps; decodes of 1, 2-3, 4-7, 8-15, 16+ sequences): the mean of predicted / measured - 1, so a
miss can be told apart as the step cost's or the scheduling's.
"""

import json
import sys
from collections import defaultdict

from workbench import LLM, Simulator
from workbench.bench.driver import run_workload
from workbench.bench.runner import warm_up_engine
from workbench.bench.stats import summarize
from workbench.bench.workload import make_workload
from workbench.sim.cost import shapes_from_timeline


def step_bias(cost, timeline) -> dict:
    """Mean predicted / measured - 1 of the step periods, by kind of step."""
    shapes, seconds = shapes_from_timeline(timeline.steps, timeline.requests)
    errors = defaultdict(list)
    for shape, sec in zip(shapes, seconds):
        kind = "prefill" if shape.prefill_tokens else f"decode<{1 << shape.num_seqs.bit_length()}"
        errors[kind].append(cost(shape) / sec - 1)
    return {k: f"{sum(v) / len(v):+.1%} (n={len(v)})" for k, v in sorted(errors.items())}


llm = LLM()
warm_up_engine(llm, llm.engine.model_config.vocab_size)
sim = Simulator.calibrate(llm)
print("calibration:", json.dumps(sim.calibration), flush=True)
tok = llm.tokenizer
cases = [
    ("W64 max_num_seqs=64", {"num_requests": 64}, {"max_num_seqs": 64}),
    ("W64 max_num_seqs=16", {"num_requests": 64}, {"max_num_seqs": 16}),
    ("poisson 1 req/s", {"num_requests": 32, "arrival": "poisson", "rate": 1.0}, {}),
    ("poisson 2 req/s", {"num_requests": 32, "arrival": "poisson", "rate": 2.0}, {}),
    ("poisson 4 req/s", {"num_requests": 48, "arrival": "poisson", "rate": 4.0}, {}),
    ("W64 batching=static", {"num_requests": 64}, {"batching": "static"}),
]
base = llm.settings()
rows = []
for name, wl, settings in cases:
    w = make_workload(tokenizer=tok, seed=0, **wl)
    llm.configure(**{"max_num_seqs": base["max_num_seqs"], "batching": base["batching"], **settings})
    llm.reset_prefix_cache()
    cursor = llm.timeline(since=1 << 62).cursor
    records, start = run_workload(llm, w.requests)
    measured = summarize(records, start)
    steps = step_bias(sim.cost, llm.timeline(since=cursor))
    predicted = sim.run(w, {**base, **settings}, record=False).summary()
    err = {k: predicted[k] / measured[k] - 1 for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")}
    rows.append({"case": name, "measured": {k: round(measured[k], 2) for k in err},
                 "predicted": {k: round(predicted[k], 2) for k in err}, "error": {k: round(v, 3) for k, v in err.items()}, "step_cost_bias": steps})
    print(json.dumps(rows[-1]), flush=True)
llm.configure(**{k: base[k] for k in ("max_num_seqs", "batching")})
worst = {k: max(abs(r["error"][k]) for r in rows) for k in rows[0]["error"]}
print("worst |error|:", json.dumps(worst))
sys.exit(0)
