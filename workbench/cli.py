"""The `workbench` command line.

    workbench serve [--model M] [--name N] [--transport ipc|tcp] [--<setting> VALUE ...]
    workbench generate PROMPT [--max-tokens N] [--temperature T] [--chat] [--model M] [--<setting> VALUE ...]
    workbench bench [--json] [--requests N] [--systems workbench,hf_sequential,hf_static,llama_server]
                    [--arrival all|poisson|bursty] [--rate R] [--seed S] [--model M] [--quick] [--<setting> VALUE ...]
                    (workbench/bench/cli.py)
    workbench lab [--model M] [--name N] [--port P] [--no-browser] [--<setting> VALUE ...] [-- JUPYTER ARGS]
    workbench runs list|show|compare|export|path [...]     (the run log; workbench/runs/cli.py)
    workbench simulate [--json] [--profile h200|h100|a100|l4|cpu | --calibrate | --engine NAME] [...]

Each subcommand registers itself in `_SUBCOMMANDS` with a function that adds its arguments and
one that runs it; imports of heavy modules stay inside the run functions so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys

from .settings import add_setting_flags, settings_from_flags


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from .ipc.engine_main import add_serve_arguments

    p = sub.add_parser(
        "serve",
        help="run a long-lived engine that clients attach to (EngineClient.connect(name))",
        description="Run a long-lived engine process. Clients attach by name with EngineClient.connect(name). "
        "Stops on Ctrl-C, SIGTERM or a client's shutdown().",
    )
    add_serve_arguments(p)
    from .http.server import add_http_arguments

    add_http_arguments(p)
    g = p.add_argument_group("replicas on Ray (workbench.cluster; needs --http)")
    g.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve N engine replicas on a Ray cluster behind the one HTTP endpoint",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster ('auto' or HOST:PORT; default: start a local one)",
    )
    g.add_argument(
        "--router",
        default=None,
        metavar="POLICY",
        help="replicas: how requests are spread (round_robin, least_loaded (default), prefix_affinity); "
        "--route: how a member is chosen (length (default), classifier, cascade, random, fixed)",
    )
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N", help="CPUs per replica (default 1)")
    r = p.add_argument_group("routing between models (workbench.routing; needs --http)")
    r.add_argument(
        "--route",
        default=None,
        metavar="NAME=MODEL,...",
        help="serve these members behind one endpoint, cheapest first (MODEL: a model as --model takes it, "
        "'default' for the embedded one, or an http(s):// URL of an OpenAI-compatible server); clients "
        "ask for model 'router' or 'router-<policy>-<threshold>'",
    )
    r.add_argument(
        "--router-threshold",
        type=float,
        default=None,
        metavar="X",
        help="the routing policy's threshold (default: the policy's own, e.g. 64 prompt tokens for length)",
    )
    g.add_argument("--replica-gpus", type=float, default=0.0, metavar="N", help="GPUs per replica (default 0)")
    p.set_defaults(_run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    if getattr(args, "replicas", None) is not None and not getattr(args, "http", None):
        print("workbench serve: --replicas serves over HTTP: give --http HOST:PORT too", file=sys.stderr)
        return 2
    if getattr(args, "replicas", None) is not None and args.replicas < 1:
        print(f"workbench serve: --replicas must be >= 1, got {args.replicas}", file=sys.stderr)
        return 2
    from .ipc.engine_main import settings_from_args

    routing = getattr(args, "route", None) is not None or getattr(args, "router", None) is not None
    try:  # a bad flag value is one line and exit code 2, before any process starts
        settings = settings_from_args(args)
        _check_router(args)
        if getattr(args, "http", None):
            from .http.server import parse_host_port

            parse_host_port(args.http)
    except (ValueError, TypeError) as e:
        print(f"workbench serve: {e}", file=sys.stderr)
        return 2
    if getattr(args, "http", None):  # engine process + OpenAI-compatible HTTP front (workbench/http/)
        from .http.server import run_front

        if getattr(args, "replicas", None) is not None:
            from .cluster import start as start_cluster

            return run_front(args, settings, start_cluster)
        return run_front(args, settings, start_router=start_router)
    if routing:
        print("workbench serve: --route and --router serve over HTTP: give --http HOST:PORT too", file=sys.stderr)
        return 2
    from .ipc.engine_main import serve

    return serve(args)


def start_router(args: argparse.Namespace, settings: dict):
    """`serve --route`: an engine process per local member (named ROUTER-MEMBER, the settings given
    to each), an HTTP client per URL, and the router over them; the members started are stopped
    again if one fails to start."""
    from .ipc.launch import start_engine
    from .remote import RemoteEngineClient
    from .routing import route

    base = getattr(args, "name", None) or "router"
    members: dict = {}
    try:
        for name, target in args.route_members.items():
            print(f"workbench: starting router member {name!r} ({target})...", file=sys.stderr, flush=True)
            if target.startswith(("http://", "https://")):
                members[name] = RemoteEngineClient.connect(url=target)
            else:
                model = None if target in ("default", "smollm2-135m") else target
                members[name] = start_engine(model, name=f"{base}-{name}", **settings)
        return route(members, policy=args.router, threshold=args.router_threshold, name=base, share=True)
    except BaseException:
        for engine in members.values():
            try:
                engine.shutdown()
            except Exception:
                pass
        raise


def _check_router(args: argparse.Namespace) -> None:
    """--router names a routing policy with --route, a replica policy with --replicas (the default
    of each filled in); --route's members parse (raises ValueError naming what is wrong)."""
    route = getattr(args, "route", None)
    if route is not None and getattr(args, "replicas", None) is not None:
        raise ValueError("--route and --replicas do not go together: route between models, or spread one over replicas")
    if route is not None:
        from .routing.policies import check_policy

        args.router = check_policy(args.router or "length")
        args.route_members = parse_route(route)
        if args.router_threshold is None:
            return
        from .routing.policies import check_threshold

        check_threshold(args.router_threshold)
        return
    from .cluster.router import POLICIES

    if getattr(args, "router", None) is None:
        args.router = "least_loaded"
    elif args.router not in POLICIES:
        raise ValueError(
            f"invalid --router {args.router!r} without --route: replicas take {', '.join(POLICIES)}; the routing "
            "policies between models (length, classifier, cascade, random, fixed) need --route NAME=MODEL,..."
        )


def parse_route(text: str) -> dict[str, str]:
    """`small=MODEL,large=URL` -> {"small": "MODEL", "large": "URL"}, in order (cheapest first)."""
    members: dict[str, str] = {}
    for part in text.split(","):
        name, eq, target = part.strip().partition("=")
        if not eq or not name.strip() or not target.strip():
            raise ValueError(f"--route takes NAME=MODEL pairs separated by commas, got {part.strip()!r}")
        if name.strip() in members:
            raise ValueError(f"--route names member {name.strip()!r} twice")
        members[name.strip()] = target.strip()
    if len(members) < 2:
        raise ValueError(f"--route needs at least two members, got {len(members)}")
    return members


def _flag_settings_or_report(args: argparse.Namespace, command: str) -> dict | None:
    """`settings_from_flags`, or None once a bad flag is reported as `workbench COMMAND: ...`."""
    try:
        return settings_from_flags(args)
    except (ValueError, TypeError) as e:
        print(f"workbench {command}: {e}", file=sys.stderr)
        return None


# ----------------------------------------------------------------------------- generate
def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from a prompt in this process, streaming tokens to the terminal",
        description="Load the engine in this process, stream the completion of PROMPT to stdout and print "
        "TTFT and tok/s to stderr.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="PROMPT is token ids ('1 2 3' or '1,2,3') and the output is printed as token ids: for a "
        "model without a tokenizer (a model shape's random weights, shape:NAME)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--model", default=None, help="'smollm2-135m' (default), a HF folder, a .gguf file or shape:NAME")
    add_setting_flags(p)
    p.set_defaults(_run=_run_generate)


def _token_ids(text: str) -> list[int]:
    """'1 2 3' or '1,2,3' as token ids (ValueError naming what is not one)."""
    words = text.replace(",", " ").split()
    bad = [w for w in words if not w.isdigit()]
    if bad or not words:
        raise ValueError(
            f"--token-ids: PROMPT must be token ids separated by spaces or commas, e.g. '1 2 3'; got {text!r}"
        )
    return [int(w) for w in words]


def _run_generate(args: argparse.Namespace) -> int:
    import time

    try:
        settings = settings_from_flags(args)
        from .sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        from .models.shapes import shape_config, shape_of

        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        ids = _token_ids(prompt) if args.token_ids else None
        if ids is not None and args.chat:
            raise ValueError("--chat renders a chat template around text: not with --token-ids")
        shape = shape_of(args.model)
        if shape is not None:
            shape_config(shape)  # an unknown shape is named before anything loads
        if shape is not None and ids is None:
            raise ValueError(
                f"{args.model} is a model shape with random weights and no tokenizer: give the prompt as "
                "token ids with --token-ids, e.g. --token-ids '1 2 3'"
            )
    except (ValueError, TypeError) as e:
        print(f"workbench generate: {e}", file=sys.stderr)
        return 2
    from .llm import LLM

    llm = LLM(args.model, **settings)
    out, sep = None, ""
    start = time.monotonic()
    try:
        for chunk in llm.stream(prompt if ids is None else None, params, chat=args.chat, prompt_token_ids=ids):
            delta = chunk.text_delta if ids is None else " ".join(map(str, chunk.token_ids_delta))
            if delta:
                sys.stdout.write(sep + delta)
                sys.stdout.flush()
                sep = "" if ids is None else " "  # token ids: space-separated
            if chunk.output is not None:
                out = chunk.output
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is not None:
        m = out.metrics
        n = len(out.token_ids)
        total = (m.finished or time.monotonic()) - (m.arrival or start)
        decode = (m.token_times[-1] - m.token_times[0]) if len(m.token_times) > 1 else 0.0
        ttft = m.ttft if m.ttft is not None else 0.0
        rate = f", {(n - 1) / decode:.1f} tok/s decode" if decode > 0 else ""
        print(
            f"[{n} tokens in {total:.2f} s: TTFT {ttft * 1e3:.0f} ms, {n / total:.1f} tok/s overall{rate}; "
            f"finish: {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)


def _add_runs(sub: argparse._SubParsersAction) -> None:
    from .runs.cli import add_runs_parser

    add_runs_parser(sub)


# ----------------------------------------------------------------------------- lab
def _add_lab(sub: argparse._SubParsersAction) -> None:
    from .jupyter.lab import add_lab_arguments

    p = sub.add_parser(
        "lab",
        help="start an engine on the embedded default model and JupyterLab on the tutorial notebooks",
        description="Start (or attach to) the engine named 'default' and open JupyterLab on notebooks/ with "
        "00-quickstart.ipynb; notebooks attach with %load_ext workbench. The engine stops when "
        "JupyterLab exits.",
    )
    add_lab_arguments(p)
    add_setting_flags(p)
    p.set_defaults(_run=_run_lab)


def _run_lab(args: argparse.Namespace) -> int:
    from .jupyter.lab import run_lab

    settings = _flag_settings_or_report(args, "lab")
    if settings is None:
        return 2
    return run_lab(args, settings)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from .sim.cli import add_simulate_parser

    add_simulate_parser(sub)


# ----------------------------------------------------------------------------- gpucheck
def _add_gpucheck(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gpucheck",
        help="prove the Triton kernels and the engine on a CUDA GPU (one JSON + markdown summary)",
        description="Check every Triton kernel against its torch reference and the device's copy bandwidth, "
        "the engine against transformers on the GPU (64 requests and a single stream, Triton kernels "
        "and torch's ops) and CUDA graphs on and off; write one JSON and a markdown summary "
        "(workbench/bench/gpucheck.py). --dry-run: the same pipeline on this CPU (Triton interpreter, "
        "tiny shapes, no speed targets).",
    )
    p.add_argument("--dry-run", action="store_true", help="run the pipeline on the CPU under the Triton interpreter")
    p.add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help="the JSON report (default docs/gpu/gpucheck.json, or gpucheck-dryrun.json); the summary "
        "goes beside it as .md",
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="SECTION,...",
        help="run only these sections (the device's limits always): kernels, exactness, triton, cuda_graphs, "
        "hf_sequential, torch_ops, sweep",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="S",
        help="skip the sections that would start after S seconds, and stop the sweep there (default 420 on a "
        "GPU, none on a dry run); the report is rewritten after every section",
    )
    p.add_argument(
        "--shape",
        default=None,
        metavar="NAME",
        help="measure the engine on this model shape (random weights made on the GPU, the transformers peers "
        "holding the same): llama3-8b, llama3.1-8b, llama3.2-1b, qwen2.5-7b, smollm2-135m (workbench/models/shapes)",
    )
    p.set_defaults(_run=_run_gpucheck)


def _run_gpucheck(args: argparse.Namespace) -> int:
    import time

    from .bench.gpu_report import write_report
    from .bench.gpucheck import run_gpucheck

    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[gpucheck +{time.monotonic() - started:.0f}s] {msg}", file=sys.stderr, flush=True)

    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    try:
        report = run_gpucheck(
            dry_run=args.dry_run,
            log=log,
            only=only,
            budget_s=args.budget_s,
            checkpoint=lambda rep: write_report(rep, args.output),
            shape=args.shape,
        )
    except (RuntimeError, ValueError) as e:
        print(f"workbench gpucheck: {e}", file=sys.stderr)
        return 2
    path, md = write_report(report, args.output)
    print(md.read_text())
    log(f"wrote {path} and {md}")
    exact = report["engine"].get("exactness") or {}
    failed = (
        [k["name"] for k in report["kernels"] if "error" in k]
        + list(report.get("errors", {}))
        + [f"exactness {name}" for name, x in exact.items() if x["identical_requests"] != x["requests"]]
        + [f"seeded sampling {name}" for name, x in exact.items() if not x.get("sampled_repeatable", True)]
    )
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- ps
def _add_ps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ps",
        help="list the engines (and Ray clusters) running on this machine",
        description="List the engine processes and clusters whose owner runs, from the runtime directory.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON list")
    p.set_defaults(_run=_run_ps)


def _run_ps(args: argparse.Namespace) -> int:
    import json
    import time

    from .cluster.engine import list_clusters
    from .ipc import connection as conn

    rows = []
    for info in conn.list_engines():
        started = _process_start(info.pid)
        rows.append(
            {
                "name": info.name,
                "kind": "engine",
                "pid": info.pid,
                "model": info.model,
                "transport": info.transport,
                "uptime_s": None if started is None else round(time.time() - started, 1),
                "log": info.log_file,
            }
        )
    for c in list_clusters():
        rows.append({"name": c["name"], "kind": "cluster", "pid": c.get("owner_pid"), "model": c.get("model"),
                     "transport": "tcp", "uptime_s": None, "log": None,
                     "replicas": [r.get("name") for r in c.get("replicas", [])]})  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no engine is running (runtime directory {conn.runtime_dir()})")
        return 0
    print(f"{'NAME':<20} {'KIND':<8} {'PID':>7} {'UPTIME':>8}  MODEL")
    for r in rows:
        up = "" if r["uptime_s"] is None else f"{r['uptime_s'] / 60:.1f} min"
        print(f"{r['name']:<20} {r['kind']:<8} {r['pid'] or '':>7} {up:>8}  {r['model'] or ''}")
    return 0


def _process_start(pid: int) -> float | None:
    """When a process started (epoch seconds), from /proc (None elsewhere)."""
    import os

    try:
        ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_SUBCOMMANDS = {
    "serve": _add_serve,
    "ps": _add_ps,
    "generate": _add_generate,
    "bench": _add_bench,
    "runs": _add_runs,
    "lab": _add_lab,
    "simulate": _add_simulate,
    "gpucheck": _add_gpucheck,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand's (each one's arguments import its modules,
    and a lent GPU machine lacks the serving stack's packages, e.g. pyzmq: gpucheck needs none of it)."""
    parser = argparse.ArgumentParser(prog="workbench", description="Serving Workbench: a live, tunable LLM engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, add in _SUBCOMMANDS.items():
        if command in (None, name):
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv and argv[0] in _SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return run(args) or 0
    except (ValueError, FileNotFoundError) as e:  # what the command was given (a model, a value): say what
        print(f"workbench {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
