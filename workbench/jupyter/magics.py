"""IPython magics: `%load_ext workbench`, then `%engine`, `%%generate`, `%timeline`, `%dashboard`.

Other modules add magics by appending ``"module:Class"`` (an IPython `Magics` subclass) to
`MAGIC_CLASSES` below, or at run time with `register_magics_class(cls)`; they reach the kernel's
engine with `engine_for_magics()`. A class that fails to import is skipped with a warning, so
one broken magic never takes the others down.

In a kernel, a `%%generate` cell runs as top-level `await` on the kernel's event loop (an input
transformer rewrites it), so widgets and the dashboard stay live while it streams, and an
interrupt cancels it (its requests are aborted in the engine). Elsewhere it blocks, with the
same output.
"""

from __future__ import annotations

import html
import importlib
import shlex
import time
import warnings
from typing import Any

import msgspec
from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from .parser import MagicArgumentParser
from .session import DEFAULT_NAME, NoEngineError, _local_name, get_session

# "module:Class" of every Magics class `%load_ext workbench` registers.
MAGIC_CLASSES: list[str] = [
    "workbench.jupyter.magics:WorkbenchMagics",
    "workbench.jupyter.sweep_magic:SweepMagics",  # %sweep / %%sweep (workbench/tuning/sweep.py)
    "workbench.jupyter.sim_magic:SimulateMagics",  # %simulate (workbench/sim/)
]

_EXTRA: list[type] = []
_LOADED_SHELLS: list[Any] = []


def register_magics_class(cls: type) -> None:
    """Add a Magics class from another module: registered in shells that already loaded the
    extension, and in every later `%load_ext workbench`."""
    if cls not in _EXTRA:
        _EXTRA.append(cls)
    for shell in _LOADED_SHELLS:
        shell.register_magics(cls)


def engine_for_magics(*, start: bool = False, say=print):
    """The kernel's engine client (the one `%engine`/`%%generate` use); `start=True` starts the
    embedded default when none runs. Raises UsageError saying what to run."""
    try:
        return get_session().require(start=start, say=say)
    except NoEngineError as e:
        raise UsageError(str(e)) from None


def load_ipython_extension(ipython) -> None:
    for spec in MAGIC_CLASSES:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001 - one broken magic must not hide the others
            warnings.warn(f"workbench: could not load magics {spec}: {e}", stacklevel=2)
            continue
        ipython.register_magics(cls)
    for cls in _EXTRA:
        ipython.register_magics(cls)
    if ipython not in _LOADED_SHELLS:
        _LOADED_SHELLS.append(ipython)
    _install_async_generate(ipython)
    if not ipython.custom_exceptions:  # never replace a handler the user set
        from .generate import GenerateInterrupted, show_interrupted

        ipython.set_custom_exc((GenerateInterrupted,), show_interrupted)


def unload_ipython_extension(ipython) -> None:
    transforms = getattr(ipython, "input_transformers_cleanup", None)
    if transforms is not None and _async_generate in transforms:
        transforms.remove(_async_generate)
    if ipython in _LOADED_SHELLS:
        _LOADED_SHELLS.remove(ipython)
    from .generate import GenerateInterrupted

    if ipython.custom_exceptions == (GenerateInterrupted,):
        ipython.set_custom_exc((), None)


# -- %%generate as top-level await ----------------------------------------------------------------
def _install_async_generate(ipython) -> None:
    install_input_transform(ipython, _async_generate)


def install_input_transform(shell, transform) -> None:
    """Add `transform` to the shell's cleanup input transformers, once (shared with `%sweep`)."""
    transforms = getattr(shell, "input_transformers_cleanup", None)
    if transforms is not None and transform not in transforms:
        transforms.append(transform)


def runs_asyncio_await() -> bool:
    """Whether the current shell runs top-level await on asyncio (a kernel, or a shell with
    autoawait on): only then can a magic's cell become an `await`."""
    try:
        from IPython import get_ipython
        from IPython.core.interactiveshell import _asyncio_runner
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return not (ip is None or not getattr(ip, "autoawait", False) or ip.loop_runner is not _asyncio_runner)


def _async_generate(lines: list[str]) -> list[str]:
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
    return [f"await __import__('workbench.jupyter.magics', fromlist=['_']).generate_cell_async({args!r}, {body!r})\n"]


async def generate_cell_async(line: str, cell: str) -> None:
    """The body of a `%%generate` cell run as top-level await (see `_async_generate`)."""
    from IPython import get_ipython

    run, opts = _prepare_generate(get_ipython(), line, cell)
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
    _finish_generate(get_ipython(), run, outputs, opts, client, cursor)


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


def _prepare_generate(shell, line: str, cell: str):
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
        _show_message(str(e), "error")
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


def _finish_generate(shell, run, outputs, opts, client, cursor) -> None:
    args = opts["args"]
    if args.var:
        shell.user_ns[args.var] = outputs
    if args.timeline:
        ids = [s.request_id for s in run.sections if s.request_id]
        show_timeline(client, since=cursor, only=ids, title="This cell's requests")


def _show_message(text: str, level: str = "info") -> None:
    from IPython.display import display

    color = {"error": "#b00020", "ok": "#2a7a2a", "warning": "#a35a00"}.get(level, "inherit")
    display({"text/plain": text, "text/html": f'<div style="color: {color};">{html.escape(text)}</div>'}, raw=True)


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
        _show_message("No engine activity to show yet: run a %%generate cell first.")
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


# -- the magics -----------------------------------------------------------------------------------
_ENGINE_USAGE = """\
%engine start [--model M] [--name N] [key=value | --key value ...]   start an engine (or attach to the running one)
%engine stop                         shut the engine down
%engine status                       engine, settings and metrics
%engine connect NAME                 attach to an engine someone else started
%engine set key=value [key=value …]  change settings (validated; see %engine settings)
%engine settings                     every setting with its kind and allowed values
%engine list                         engines running on this machine"""


@magics_class
class WorkbenchMagics(Magics):
    @line_magic
    def engine(self, line: str = ""):
        """Start, stop, inspect, attach to and configure the engine. `%engine help` for usage."""
        try:
            words = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%engine: {e}") from None
        if not words:
            words = ["status"]
        cmd, rest = words[0], words[1:]
        handler = getattr(self, f"_engine_{cmd}", None)
        if handler is None:
            raise UsageError(f"%engine: unknown subcommand {cmd!r}\n{_ENGINE_USAGE}")
        return handler(rest)

    # %engine start
    def _engine_start(self, words: list[str]):
        from ..settings import setting_kind, validate

        opts, settings = _parse_start(words)
        session = get_session()
        name = opts.get("name") or (session.name if _local_name(session.name) else DEFAULT_NAME)
        from ..ipc import connection as conn

        holder = conn.live_engine(name)
        if holder is not None:
            current = session.client(reconnect=False)
            client = current if current is not None and current.name == name else session.connect(name)
            msg = (
                f"Engine {name!r} is already running (pid {client.pid}, {client.engine_info.get('model')}): "
                "attached to it."
            )
            level = "ok"
            if opts.get("model"):
                msg += (
                    f" It was NOT started on --model {opts['model']}: it keeps serving its own model. "
                    "`%engine stop` first to start another model."
                )
                level = "warning"
            fixed = {k: v for k, v in settings.items() if setting_kind(k) == "restart"}
            current = client.settings()
            differ = {k: v for k, v in fixed.items() if current.get(k) != v}
            if differ:
                msg += (
                    f" Settings fixed at start differ ({', '.join(f'{k}={v!r}' for k, v in differ.items())}): "
                    "`%engine stop` and start again to change them."
                )
            live = {k: v for k, v in settings.items() if k not in fixed}
            if live:
                client.configure(**live)
                msg += f" Applied {', '.join(f'{k}={v!r}' for k, v in live.items())}."
            _show_message(msg, "warning" if differ else level)
            return None
        validate(settings)
        t0 = time.monotonic()
        print(f"Starting engine {name!r} on {opts.get('model') or 'the embedded default model'}…", flush=True)
        try:
            client = session.start(opts.get("model"), name=name, timeout=float(opts.get("timeout", 600)), **settings)
        except Exception as e:
            raise UsageError(f"%engine start: {e}") from None
        info = client.engine_info
        _show_message(
            f"Engine {name!r} ready: {info.get('model')} on {info.get('device')} (pid {client.pid}) in "
            f"{time.monotonic() - t0:.1f} s. It stops with this kernel or with `%engine stop`.",
            "ok",
        )
        return None

    def _engine_stop(self, words: list[str]):
        name = get_session().stop()
        _show_message(f"Engine {name!r} stopped." if name else "No engine is running.", "ok" if name else "info")

    def _engine_status(self, words: list[str]):
        client = engine_for_magics()
        from IPython.display import display

        display(status_table(client.status(), client.settings(), client.metrics(), client.schema()), raw=True)

    def _engine_connect(self, words: list[str]):
        if len(words) != 1:
            raise UsageError("usage: %engine connect NAME")
        try:
            client = get_session().connect(words[0])
        except Exception as e:
            raise UsageError(f"%engine connect: {e}") from None
        if words[0].startswith(("http://", "https://")):
            _show_message(
                f"Attached to the OpenAI-compatible server {words[0]} ({client.engine_info.get('model')}); "
                f"{_share_remote(words[0], client)}",
                "ok",
            )
            return
        _show_message(
            f"Attached to engine {client.name!r} (pid {client.pid}, {client.engine_info.get('model')}).", "ok"
        )

    def _engine_set(self, words: list[str]):
        from ..settings import parse_value, schema, validate

        if not words:
            raise UsageError("usage: %engine set key=value [key=value …]  (see %engine settings)")
        changes = {}
        for w in words:
            key, eq, text = w.partition("=")
            if not eq:
                raise UsageError(f"%engine set: expected key=value, got {w!r}")
            try:
                changes[key.strip()] = parse_value(key.strip(), text)
            except ValueError as e:
                raise UsageError(f"%engine set: {e}") from None
        try:
            validate(changes)
        except (ValueError, TypeError) as e:
            raise UsageError(f"%engine set: {e}") from None
        client = engine_for_magics()
        before = client.settings()
        kinds = {e["name"]: e["kind"] for e in schema()}
        slow = [
            k
            for k, v in changes.items()
            if before.get(k) != v and (kinds.get(k) in ("relayout", "reload") or (k == "speculative" and v == "draft"))
        ]
        if slow:  # said first: a re-layout or loading a draft model takes seconds
            _show_message(
                "Applying " + ", ".join(f"{k}={changes[k]!r}" for k in slow) + ": the engine rebuilds "
                "or loads what it needs, pausing its steps meanwhile…",
                "info",
            )
        t0 = time.monotonic()
        try:
            after = client.configure(**changes)
        except (ValueError, TypeError) as e:
            raise UsageError(f"%engine set: {e}") from None
        took = time.monotonic() - t0
        changed = [k for k in changes if before.get(k) != after.get(k)]
        same = [k for k in changes if k not in changed]
        parts = [f"{k}: {before.get(k)!r} → {after.get(k)!r}" for k in changed]
        unchanged = f"already {', '.join(f'{k}={after.get(k)!r}' for k in same)} (no change)" if same else ""
        if not changed:
            _show_message(f"Nothing to apply: {unchanged}.", "info")
            return
        _show_message(f"Applied in {took * 1e3:.0f} ms: " + "; ".join(parts) + (f"; {unchanged}" if same else ""), "ok")

    def _engine_settings(self, words: list[str]):
        from IPython.display import display

        from ..settings import allowed_values, schema

        client = get_session().client()
        current = client.settings() if client is not None else {}
        rows = [
            (e["name"], e["kind"], repr(current.get(e["name"], e["default"])), allowed_values(e["name"]), e["help"])
            for e in schema()
        ]
        display(_table(["setting", "kind", "value", "allowed", "what"], rows), raw=True)

    def _engine_list(self, words: list[str]):
        from IPython.display import display

        from ..ipc import connection as conn

        rows = [(c.name, c.pid, c.model or "(default)", c.transport) for c in conn.list_engines()]
        if not rows:
            _show_message("No engine is running on this machine.")
            return
        display(_table(["name", "pid", "model", "transport"], rows), raw=True)

    def _engine_help(self, words: list[str]):
        print(_ENGINE_USAGE)

    # %%generate
    @cell_magic
    def generate(self, line: str = "", cell: str = ""):
        """Generate from the cell's prompts (separate them with a line `---`). `%%generate --help`."""
        run, opts = _prepare_generate(self.shell, line, cell)
        if run is None:
            return None
        client, cursor = opts["client"], opts["cursor"]
        outputs = run.run(client)
        _finish_generate(self.shell, run, outputs, opts, client, cursor)
        return None

    # %timeline
    @line_magic
    def timeline(self, line: str = ""):
        """%timeline [--last N]: the engine's activity over the last N seconds (default 60)."""
        p = MagicArgumentParser(prog="%timeline", description="Show recent engine activity as a timeline.")
        p.add_argument("--last", type=float, default=60.0, metavar="N", help="seconds to show (default 60)")
        args = p.parse_args(shlex.split(line))
        if args is None:  # --help
            return
        show_timeline(engine_for_magics(), last_s=args.last, title=f"Engine timeline, last {args.last:g} s")

    # %dashboard
    @line_magic
    def dashboard(self, line: str = ""):
        """%dashboard [--hz HZ] [--window SECONDS]: live controls and plots for the engine."""
        from IPython.display import display

        from .dashboard import Dashboard

        p = MagicArgumentParser(prog="%dashboard", description="Controls for every live setting and live plots.")
        p.add_argument("--hz", type=float, default=10.0, help="plot refresh rate (default 10, 1-20)")
        p.add_argument("--window", type=float, default=60.0, help="seconds of activity shown (default 60)")
        p.add_argument("--no-start", action="store_true", help="do not start the default engine when none runs")
        p.add_argument(
            "--keep",
            action="store_true",
            help="keep the dashboard this magic opened before (default: close it, one feed per kernel)",
        )
        args = p.parse_args(shlex.split(line))
        if args is None:  # --help
            return None
        previous = self.shell.user_ns.get("_dashboard")
        if not args.keep and isinstance(previous, Dashboard):
            previous.close()
        notes: list[str] = []
        client = engine_for_magics(start=not args.no_start, say=notes.append)
        for n in notes:
            _show_message(n)
        dash = Dashboard(get_session(), client=client, hz=min(20.0, max(1.0, args.hz)), window_s=args.window)
        display(dash)
        self.shell.user_ns["_dashboard"] = dash
        return None


def _parse_start(words: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`--model M --name N --timeout S` and settings as key=value or --key value / --key=value."""
    from ..settings import parse_value, setting_names

    opts: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    names = set(setting_names())
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            key, eq, val = w[2:].partition("=")
            if not eq:
                if i + 1 >= len(words):
                    raise UsageError(f"%engine start: {w} needs a value")
                val = words[i + 1]
                i += 1
            key = key.replace("-", "_")
        else:
            key, eq, val = w.partition("=")
            if not eq:
                raise UsageError(f"%engine start: expected key=value or --option value, got {w!r}")
        if key in ("model", "name", "timeout"):
            opts[key] = val
        elif key in names:
            try:
                settings[key] = parse_value(key, val)
            except ValueError as e:
                raise UsageError(f"%engine start: {e}") from None
        else:
            raise UsageError(f"%engine start: unknown option or setting {key!r}; settings: {', '.join(sorted(names))}")
        i += 1
    from ..settings import validate

    try:
        settings = validate(settings)
    except (ValueError, TypeError) as e:
        raise UsageError(f"%engine start: {e}") from None
    return opts, settings


# -- tables ---------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[tuple], title: str | None = None) -> dict[str, str]:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    text = [title] if title else []
    text.append("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    text.append("  ".join("-" * w for w in widths))
    text += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    cell = 'style="text-align: left; padding: 2px 10px 2px 0;"'
    h = [
        f"<b>{html.escape(title)}</b>" if title else "",
        '<table style="border-collapse: collapse; font-size: 12px;">',
        "<tr>" + "".join(f"<th {cell}>{html.escape(str(x))}</th>" for x in headers) + "</tr>",
    ]
    for r in rows:
        h.append("<tr>" + "".join(f"<td {cell}>{html.escape(str(x))}</td>" for x in r) + "</tr>")
    h.append("</table>")
    return {"text/plain": "\n".join(text), "text/html": "".join(h)}


def status_table(status: dict, settings: dict, metrics: dict, schema: list[dict]) -> dict[str, str]:
    """`%engine status`: the engine, its settings (with kinds) and current metrics, as one table."""
    kinds = {e["name"]: e["kind"] for e in schema}
    rows: list[tuple] = []
    up = status.get("uptime_s", 0.0)
    for key, label in (
        ("name", "engine"),
        ("pid", "pid"),
        ("model", "model"),
        ("device", "device"),
        ("dtype", "dtype"),
        ("attention_backend", "attention"),
        ("attention_backend_reason", "attention: why"),
        ("kernel_variant", "kernels"),
        ("kernel_variant_reason", "kernels: why"),
        ("compute_path", "large steps in"),
        ("compute_path_reason", "large steps: why"),
        ("num_kv_blocks", "KV blocks"),
        ("block_size", "block size"),
        ("max_model_len", "max model len"),
        ("num_clients", "clients"),
        ("num_requests", "requests in flight"),
    ):
        if key in status:
            rows.append(("engine", label, status[key]))
    rows.append(("engine", "uptime", f"{up:.0f} s"))
    for name, value in settings.items():
        rows.append((f"setting ({kinds.get(name, '?')})", name, repr(value)))
    for key, label, fmt in (
        ("output_tok_s", "output tok/s", "{:.1f}"),
        ("num_running", "running", "{}"),
        ("num_waiting", "waiting", "{}"),
        ("kv_usage", "KV usage", "{:.0%}"),
        ("prefix_hit_rate", "prefix hit rate", "{:.0%}"),
        ("spec_acceptance_rate", "spec acceptance", "{:.0%}"),
        ("ttft_p50_ms", "TTFT p50", "{:.0f} ms"),
        ("itl_p50_ms", "ITL p50", "{:.0f} ms"),
        ("total_finished", "finished requests", "{}"),
        ("total_output_tokens", "output tokens", "{}"),
    ):
        if key in metrics:
            rows.append(("metrics", label, fmt.format(metrics[key])))
    return _table(["", "name", "value"], rows, title=f"Engine {status.get('name')!r}")


def _share_remote(url: str, client) -> str:
    """Register a remote server by name so the lab panel (and other notebooks) can pick it too."""
    import re

    from ..ipc import connection as conn
    from ..remote import list_remotes, register_remote

    for r in list_remotes():
        if r["url"].rstrip("/") == url.rstrip("/"):
            return f"listed in the lab panel as {r['name']!r}."
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", url.split("://", 1)[1]).strip("-.")[:64] or "remote"
    try:
        conn.check_name(name)
        register_remote(name, url, model=client.engine_info.get("model"))
    except (ValueError, OSError) as e:
        return f"not listed in the lab panel ({e})."
    return f"listed in the lab panel as {name!r}; its settings are read-only."
