"""Which calibration parts predict Poisson serving best on a lone engine? (docs/benchmarks.md)

    python docs/probes/sim_calibration_parts.py --rounds 4

Each round, on one engine process of the embedded default: the default calibration (bursts), then
closed-loop runs at 1, 2, 4 and 8 requests in flight (each new prompt joins the decodes of the
others: the "staggered" steps a Poisson run makes), then 24 served prompts of another seed, then
the measured run (notebook 08's workload). Fits over several mixes of those steps then predict the
measured run; prints each fit's errors (TTFT p50, ITL p50, tok/s) and per kind of step, and the
medians over rounds.
"""

import argparse
import collections

import numpy as np

import workbench
from workbench.bench.driver import run_workload
from workbench.bench.stats import summarize
from workbench.bench.workload import make_workload
from workbench.ipc.launch import start_engine
from workbench.sim.cost import FittedCost, shapes_from_timeline
from workbench.tuning.workload import make_sweep_workload

KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")
MIXES = {
    "bursts (default)": ["burst"],
    "bursts + closed 2,4": ["burst", "closed2", "closed4"],
    "bursts + closed 1,2,4": ["burst", "closed1", "closed2", "closed4"],
    "bursts + closed 1-8": ["burst", "closed1", "closed2", "closed4", "closed8"],
    "served": ["served"],
}


def kind(s):
    if s.prefill_tokens:
        return ("mixed" if s.decode_tokens else "prefill") + str(s.prefill_tokens.bit_length())
    return f"dec{min(s.num_seqs.bit_length(), 5)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    eng = start_engine(None, name="calibration-parts", timeout=300)
    try:
        vocab = eng.status()["vocab_size"]

        def poisson(seed):
            shape = {"prompt_len": (32, 256), "output_len": (32, 96)}
            return make_sweep_workload(
                eng, {"num_requests": 24, "seed": seed, "arrival": "poisson", "rate": 2.0, **shape}
            )

        def steps_of(run, *args, **kwargs):
            cursor = eng.timeline(since=1 << 62).cursor
            out = run(eng, *args, **kwargs)
            tl = eng.timeline(since=cursor)
            return shapes_from_timeline(tl.steps, tl.requests), out

        errors = collections.defaultdict(list)
        for rnd in range(args.rounds):
            parts = {"burst": steps_of(workbench.Simulator.calibrate)[0]}
            for k in (1, 2, 4, 8):
                closed = make_workload(6 * k, seed=17 + k, vocab_size=vocab, prompt_len=(32, 448), output_len=(16, 64))
                parts[f"closed{k}"] = steps_of(run_workload, closed.requests, max_concurrency=k)[0]
            eng.reset_prefix_cache()
            parts["served"] = steps_of(run_workload, poisson(7 + rnd).requests)[0]
            w = poisson(3)
            eng.reset_prefix_cache()
            (shapes, seconds), (records, start) = steps_of(run_workload, w.requests)
            measured = summarize(records, start)
            for name, mix in MIXES.items():
                fit = FittedCost.fit(sum((parts[p][0] for p in mix), []), sum((parts[p][1] for p in mix), []))
                sim = workbench.Simulator(
                    None,
                    eng.status().get("model"),
                    cost=fit,
                    settings=eng.settings(),
                    num_kv_blocks=eng.status().get("num_kv_blocks"),
                    tokenizer=getattr(eng, "tokenizer", None),
                    vocab_size=vocab,
                )
                predicted = sim.run(w, eng.settings(), record=False).summary()
                errs = [predicted[k] / measured[k] - 1 for k in KEYS]
                errors[name].append(errs)
                by_kind = collections.defaultdict(list)
                for s, y in zip(shapes, seconds):
                    by_kind[kind(s)].append(fit(s) / y - 1)
                print(
                    rnd,
                    f"{name:20s}",
                    " ".join(f"{k}:{e:+.0%}" for k, e in zip(KEYS, errs)),
                    "|",
                    " ".join(f"{k}({len(v)}):{np.mean(v):+.0%}" for k, v in sorted(by_kind.items())),
                    flush=True,
                )
        for name, errs in errors.items():
            print(f"median {name:20s}", " ".join(f"{k}:{e:+.0%}" for k, e in zip(KEYS, np.median(errs, axis=0))))
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
