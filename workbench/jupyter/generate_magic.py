"""`%%generate`: its arguments, the cell's requests prepared and run (streamed into the cell's
output), and `show_timeline`, the static timeline a cell or `%timeline` shows. In a kernel the
cell runs as top-level `await` (`async_generate`, an input transformer installed by
`%load_ext workbench`)."""

from __future__ import annotations

import shlex
import time

import msgspec
from IPython.core.error import UsageError

from .cells import runs_asyncio_await, show_message
from .parser import MagicArgumentParser
from .session import NoEngineError, get_session


def async_generate(lines: list[str]) -> list[str]:
    """`%%generate ARGS` + body -> `await` of the same magic, when the shell runs top-level await
    on asyncio (a kernel, or a shell with autoawait on)."""
    if not lines or not lines[0].startswith("%%generate"):
        return lines
    first = lines[0].rstrip("\r\n")
    if first != "%%generate" and not first.startswith(("%%generate ", "%%generate\t")):
        return lines
    if not runs_asyncio_await():
        return lines
    args = first[len("%%generate") :].strip()
    body = "".join(lines[1:])
    module = "__import__('workbench.jupyter.generate_magic', fromlist=['_'])"
    return [f"await {module}.generate_cell_async({args!r}, {body!r})\n"]


async def generate_cell_async(line: str, cell: str) -> None:
    """The body of a `%%generate` cell run as top-level await (see `async_generate`)."""
    from IPython import get_ipython

    run, opts = prepare_generate(get_ipython(), line, cell)
    if run is None:
        return
    client, cursor = opts["client"], opts["cursor"]
    try:
        outputs = await run.arun(client)
    except BaseException:
        if not run.interrupted:
            raise
        from .generate import GenerateInterrupted

        raise GenerateInterrupted(run.summary()) from None
    finish_generate(get_ipython(), run, outputs, opts, client, cursor)


# -- argument parsing -----------------------------------------------------------------------------
def _generate_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(
        prog="%%generate",
        add_help=True,
        description="Generate from the prompts in the cell body (prompts separated by a line holding "
        "only --- are submitted together, so they batch; `--- max_tokens=8` gives the next "
        "prompt its own max_tokens, temperature, top_p, top_k, min_p, seed, ignore_eos, a penalty or min_tokens).",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens per completion (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches P (default 1.0: all)",
    )
    p.add_argument("--top-k", type=int, default=-1, help="sample among the K likeliest tokens (default -1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens under P x the likeliest's probability")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same text")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's, over prompt and output (1: off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0: off)")
    p.add_argument(
        "--logit-bias",
        action="append",
        default=None,
        metavar="ID:BIAS",
        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)",
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence before this many tokens")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g = p.add_argument_group("structured output (one of)")
    g.add_argument(
        "--json-schema",
        default=None,
        metavar="SCHEMA",
        help="the output is JSON valid under SCHEMA: a notebook variable (a dict), a .json file or JSON text",
    )
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument(
        "--grammar", default=None, metavar="EBNF", help="the output matches this EBNF grammar (a variable or text)"
    )
    g.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--chat", dest="chat", action="store_true", default=False, help="apply the model's chat template")
    p.add_argument("--no-chat", dest="chat", action="store_false")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (seeds seed, seed+1, … if --seed)")
    p.add_argument(
        "-o", "--output", dest="var", default=None, metavar="VAR", help="store the list of RequestOutputs in VAR"
    )
    p.add_argument("--timeline", action="store_true", help="show this cell's requests on a timeline")
    p.add_argument(
        "--no-start",
        action="store_true",
        help="do not start the embedded default engine when none runs (say what to run)",
    )
    p.add_argument("--hz", type=float, default=10.0, help="display refresh rate (default 10, at most 20)")
    p.add_argument("--timeout", type=float, default=None, help="give up (and abort) after this many seconds")
    return p


def prepare_generate(shell, line: str, cell: str):
    from ..sampling_params import SamplingParams
    from .generate import GenerateRun, parse_prompts

    args = _generate_parser().parse_args(shlex.split(line))
    if args is None:  # --help
        return None, {}
    if args.var is not None and not args.var.isidentifier():
        raise UsageError(f"-o needs a Python variable name, got {args.var!r}")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            logit_bias=_logit_bias(args.logit_bias),
            min_tokens=args.min_tokens,
            structured=_structured(args, shell.user_ns if shell is not None else {}),
        )
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    try:
        prompts = parse_prompts(cell or "")
        for _, over in prompts:  # check per-prompt overrides before anything is submitted
            if over:
                msgspec.structs.replace(params, **over)  # runs the same checks as SamplingParams()
    except (TypeError, ValueError) as e:
        raise UsageError(f"%%generate: {e}") from None
    if not prompts:
        raise UsageError(
            "%%generate: the cell holds no prompt; write it under the %%generate line "
            "(separate several prompts with a line holding only ---)"
        )
    notes: list[str] = []
    session = get_session()
    try:
        client = session.require(start=not args.no_start, say=notes.append)
    except NoEngineError as e:
        show_message(str(e), "error")
        return None, {}
    note = " ".join(notes) or None
    cursor = client.timeline(since=1 << 62).cursor if args.timeline else None
    run = GenerateRun(
        prompts, params, n=args.n, chat=args.chat, hz=min(20.0, max(0.5, args.hz)), note=note, timeout=args.timeout
    )
    return run, {"client": client, "cursor": cursor, "args": args}


def _structured(args, user_ns: dict) -> dict | None:
    """--json-schema / --json-object / --regex / --grammar / --choice as SamplingParams.structured
    (SamplingParams says so when more than one is given)."""
    from pathlib import Path

    spec: dict = {}
    if args.json_schema is not None:
        value = args.json_schema
        if value.isidentifier() and value in user_ns:
            value = user_ns[value]
        elif value.endswith(".json") and Path(value).is_file():
            value = Path(value).read_text()
        spec["json"] = value
    if args.json_object:
        spec["json_object"] = True
    if args.regex is not None:
        spec["regex"] = args.regex
    if args.grammar is not None:
        spec["grammar"] = user_ns.get(args.grammar, args.grammar) if args.grammar.isidentifier() else args.grammar
    if args.choice:
        spec["choice"] = list(args.choice)
    if spec.get("json") is not None and not isinstance(spec["json"], (dict, str)):
        raise ValueError(f"--json-schema {args.json_schema} must name a dict or JSON text")
    return spec or None


def _logit_bias(pairs: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID:BIAS options as SamplingParams.logit_bias."""
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        tok, _, bias = pair.partition(":")
        try:  # no colon leaves bias "", which float() refuses too
            out[int(tok)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID:BIAS (a token id and a number), got {pair!r}") from None
    return out


def finish_generate(shell, run, outputs, opts, client, cursor) -> None:
    args = opts["args"]
    if args.var:
        shell.user_ns[args.var] = outputs
    if args.timeline:
        ids = [s.request_id for s in run.sections if s.request_id]
        show_timeline(client, since=cursor, only=ids, title="This cell's requests")


def show_timeline(
    client,
    *,
    since: int | None = None,
    until: int | None = None,
    only=None,
    last_s: float | None = None,
    title: str | None = None,
):
    """Render engine activity (the cursor range after `since`, up to `until` included, or the
    last `last_s` seconds) as a static timeline; returns the view (None when there was nothing
    to show)."""
    from IPython.display import display

    from .reducer import TimelineReducer
    from .views import static_timeline, to_columns

    tl = client.timeline(since=since)
    if until is not None:
        tl.steps = [s for s in tl.steps if s.seq <= until]
        tl.requests = [r for r in tl.requests if r.seq <= until]
        tl.changes = [c for c in tl.changes if c.seq <= until]
    if last_s is not None:
        cutoff = time.monotonic() - last_s
        tl.steps = [s for s in tl.steps if s.end >= cutoff]
        tl.requests = [r for r in tl.requests if r.time >= cutoff]
        tl.changes = [c for c in tl.changes if c.end >= cutoff]
    red = TimelineReducer(only=only)
    red.add(tl)
    red.tick(float("inf"), grace=0)
    data = to_columns(red)
    steps = len(data["steps"]["left"])
    if not steps and not data["lanes"]["left"]:
        show_message("No engine activity to show yet: run a %%generate cell first.")
        return None
    requests = len({r for r in data["lanes"]["request"]})
    wall = (max(data["steps"]["right"]) - min(data["steps"]["left"])) if steps else 0.0
    tokens = sum(s.output_tokens for s in tl.steps if only is None or any(b.request_id in set(only) for b in s.batch))
    summary = f"{steps} steps, {requests} requests, {tokens} output tokens over {wall:.2f} s"
    view = static_timeline(
        data, red.num_lanes, lane_labels=red.lane_labels, title=(title or "Engine timeline") + f" — {summary}"
    )
    display({"text/plain": f"[timeline: {summary}]"}, raw=True)
    display(view.widget())
    return view
