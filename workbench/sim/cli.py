"""`workbench simulate`: a serving what-if from the command line.

    workbench simulate --profile h200 --requests 1000 --arrival poisson --rate 50 --replicas 2 --json
    workbench simulate --calibrate --requests 64 --rate 4          # fitted on this host's engine first
    workbench simulate --engine lab --replicas-for --slo-ttft-ms 500 --slo-itl-ms 50 --rate 20

`--json` prints one object whose `results` maps "simulated" to the bench's keys (`output_tok_s`,
`ttft_p50_ms`, ... plus goodput, SLO attainment, cost and energy) and `simulator` says where the
step costs came from (the profile's figures, or the fit and its error).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..settings import add_setting_flags, settings_from_flags


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers LO,HI, got {text!r}") from None
    return a, b


DESCRIPTION = (
    "Run the engine's own scheduler on simulated time: step durations from a named accelerator's "
    "roofline or fitted from a real engine's steps; replicas behind a router, prefill/decode "
    "disaggregation, SLO goodput, cost. Recorded in the run log (kind simulation)."
)


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        description=DESCRIPTION,
        help="simulate serving a workload at cluster scale (the engine's scheduler, no model)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_simulate_arguments(
        p, calibrate_help="fit the step costs from an engine in this process on --model (runs a short calibration)"
    )
    add_setting_flags(p, "engine settings the simulated replicas run with")
    p.set_defaults(_run=run_simulate)


def add_simulate_arguments(p: argparse.ArgumentParser, *, calibrate_help: str) -> None:
    """The options `workbench simulate` and `%simulate` share."""
    from .profiles import PROFILES
    from .simulator import ROUTERS

    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--profile",
        default="h200",
        choices=[*PROFILES, "cpu"],
        help="accelerator whose roofline gives the step costs (default h200; cpu: this host: its newest "
        "recorded fit for the model, else its measured roofline)",
    )
    src.add_argument("--calibrate", action="store_true", help=calibrate_help)
    src.add_argument(
        "--engine",
        default=None,
        metavar="NAME",
        help="fit the step costs from the running engine NAME (runs a short calibration on it)",
    )
    p.add_argument(
        "--calibrations",
        type=int,
        default=1,
        metavar="N",
        help="with --calibrate or --engine: calibrate N times and fit over all their steps (a shared "
        "host's speed drifts; one calibration sees one moment of it). Default 1",
    )
    p.add_argument("--model", default=None, help="the model whose shape the roofline uses (default: the embedded one)")
    p.add_argument("--requests", type=int, default=64, metavar="N", help="number of requests (default 64)")
    p.add_argument(
        "--arrival", choices=["all", "poisson", "bursty"], default="poisson", help="arrivals (default poisson)"
    )
    p.add_argument("--rate", type=float, default=4.0, help="poisson arrivals: requests per second (default 4)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--prompt-len", type=_pair, default=None, metavar="LO,HI", help="prompt lengths (default 32,512)")
    p.add_argument("--output-len", type=_pair, default=None, metavar="LO,HI", help="output lengths (default 32,256)")
    p.add_argument("--replicas", type=int, default=1, help="colocated replicas (default 1)")
    p.add_argument("--router", choices=ROUTERS, default="round_robin", help="how requests pick a replica")
    p.add_argument(
        "--disaggregated",
        type=_pair,
        default=None,
        metavar="P,D",
        help="P prefill replicas hand each request's KV to one of D decode replicas",
    )
    p.add_argument("--kv-transfer-gbs", type=float, default=25.0, help="KV transfer bandwidth, GB/s (default 25)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="SLO: time to first token, ms")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="SLO: mean time per output token, ms")
    p.add_argument(
        "--replicas-for",
        action="store_true",
        help="report the smallest replica count whose SLO attainment reaches 99%% at this rate",
    )
    p.add_argument(
        "--spec-acceptance",
        type=float,
        default=None,
        metavar="P",
        help="with --speculative: chance each draft token is accepted (default: measured at calibration, else 0.6)",
    )
    p.add_argument("--price-per-hour", type=float, default=None, help="USD per replica-hour (default by device)")
    p.add_argument("--watts", type=float, default=None, help="watts per replica (default by device)")


def simulate_from_args(args: argparse.Namespace, settings: dict[str, Any], engine=None):
    """Build the simulator the arguments ask for and run it: (report dict, SimResult). `engine`:
    the engine `--calibrate` fits on (None: an in-process LLM on --model)."""
    from .simulator import Simulator

    workload: dict[str, Any] = {
        "num_requests": args.requests,
        "arrival": args.arrival,
        "rate": args.rate,
        "seed": args.seed,
    }
    if args.prompt_len:
        workload["prompt_len"] = args.prompt_len
    if args.output_len:
        workload["output_len"] = args.output_len
    slo = {k: v for k, v in (("ttft_ms", args.slo_ttft_ms), ("itl_ms", args.slo_itl_ms)) if v is not None} or None
    if args.replicas_for and not slo:
        raise ValueError("--replicas-for needs --slo-ttft-ms and/or --slo-itl-ms")
    if args.calibrations < 1 or (args.calibrations > 1 and not (args.calibrate or args.engine)):
        raise ValueError(
            f"--calibrations must be >= 1 and, above 1, comes with --calibrate or --engine; got {args.calibrations}"
        )
    if args.calibrate or args.engine:
        from ..engines import connect

        if args.engine:
            engine = connect(args.engine)
        elif engine is None:
            from ..llm import LLM

            engine = LLM(args.model, **settings)
        _log(
            "calibrating on "
            + (f"engine {args.engine!r}" if args.engine else "the engine")
            + (f", {args.calibrations} times" if args.calibrations > 1 else "")
        )
        sims = [Simulator.calibrate(engine) for _ in range(args.calibrations)]
        sim = sims[0] if len(sims) == 1 else Simulator.pooled(sims)
        cal = sim.calibration or {}
        _log(
            f"fitted on {cal.get('steps')} steps: mean error {cal.get('mape', 0) * 100:.1f}%, r2 {cal.get('r2', 0):.3f}"
        )
    else:
        # this host's own fit, once one is recorded, replaces its measured roofline
        found = Simulator.latest_fit(args.model) if args.profile == "cpu" else None
        sim = found if found is not None else Simulator(args.profile, args.model, settings=settings)
    res = sim.run(
        workload,
        settings,
        replicas=args.replicas,
        router=args.router,
        disaggregated=args.disaggregated,
        kv_transfer_gbs=args.kv_transfer_gbs,
        slo=slo,
        spec_acceptance=args.spec_acceptance,
        price_per_hour=args.price_per_hour,
        watts=args.watts,
    )
    report = {
        "mode": "simulate",
        "workload": workload,
        "simulator": sim.describe(),
        "config": {
            k: res.config[k] for k in ("replicas", "router", "disaggregated", "slo", "num_kv_blocks", "settings")
        },
        "results": {"simulated": res.summary()},
        "roofline": sim.describe().get("cost", {}),
        "run_id": res.run_id,
    }
    if args.replicas_for:
        report["replicas_for_slo"] = sim.replicas_for(slo, workload, settings=settings)
    return report, res


def run_simulate(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_flags(args)
        report, _ = simulate_from_args(args, settings)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"workbench simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(format_report(report))
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def format_report(rep: dict) -> str:
    from ..bench.report import arrival_text

    s = rep["results"]["simulated"]
    cfg, sim, w = rep["config"], rep["simulator"], rep["workload"]
    arrival = arrival_text(w)
    layout = (
        f"disaggregated {cfg['disaggregated'][0]} prefill + {cfg['disaggregated'][1]} decode"
        if cfg["disaggregated"]
        else f"{cfg['replicas']} replica(s), {cfg['router']}"
    )
    cost = sim.get("cost", {})
    src = (
        f"fitted ({cost.get('steps')} steps, mean error {cost.get('mape', 0) * 100:.1f}%)"
        if cost.get("kind") == "fitted"
        else f"{cost.get('profile')} roofline ({cost.get('source')})"
    )
    lines = [
        f"workbench simulate: {w['num_requests']} requests ({arrival}), {layout}; step costs: {src}",
        f"  output {s['output_tok_s']:.1f} tok/s over {s['duration_s']:.2f} s simulated ({s['engine_steps']:,} steps)",
        f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms; ITL p50 {s['itl_p50_ms']:.2f} ms, "
        f"p99 {s['itl_p99_ms']:.2f} ms",
        f"  SLO attainment {s['slo_attainment'] * 100:.1f}% (goodput {s['goodput_req_s']:.2f} req/s); "
        f"KV peak {s['kv_usage_peak'] * 100:.0f}%; {s['preemptions']} preemptions",
        f"  ${s['cost_per_mtok']:.3f} per million output tokens, {s['joules_per_token']:.3f} J/token"
        if s.get("cost_per_mtok") is not None
        else "  cost: nothing produced",
    ]
    if "replicas_for_slo" in rep:
        n = rep["replicas_for_slo"]
        lines.append(f"  smallest replica count meeting the SLO: {n if n is not None else 'more than 64'}")
    return "\n".join(lines)
