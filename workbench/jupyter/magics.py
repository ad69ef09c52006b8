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

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from .cells import install_input_transform, show_message
from .generate_magic import async_generate, finish_generate, prepare_generate, show_timeline
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
    install_input_transform(ipython, async_generate)
    if not ipython.custom_exceptions:  # never replace a handler the user set
        from .generate import GenerateInterrupted, show_interrupted

        ipython.set_custom_exc((GenerateInterrupted,), show_interrupted)


def unload_ipython_extension(ipython) -> None:
    transforms = getattr(ipython, "input_transformers_cleanup", None)
    if transforms is not None and async_generate in transforms:
        transforms.remove(async_generate)
    if ipython in _LOADED_SHELLS:
        _LOADED_SHELLS.remove(ipython)
    from .generate import GenerateInterrupted

    if ipython.custom_exceptions == (GenerateInterrupted,):
        ipython.set_custom_exc((), None)


# -- %%generate as top-level await ----------------------------------------------------------------
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
            show_message(msg, "warning" if differ else level)
            return None
        validate(settings)
        t0 = time.monotonic()
        print(f"Starting engine {name!r} on {opts.get('model') or 'the embedded default model'}…", flush=True)
        try:
            client = session.start(opts.get("model"), name=name, timeout=float(opts.get("timeout", 600)), **settings)
        except Exception as e:
            raise UsageError(f"%engine start: {e}") from None
        info = client.engine_info
        show_message(
            f"Engine {name!r} ready: {info.get('model')} on {info.get('device')} (pid {client.pid}) in "
            f"{time.monotonic() - t0:.1f} s. It stops with this kernel or with `%engine stop`.",
            "ok",
        )
        return None

    def _engine_stop(self, words: list[str]):
        name = get_session().stop()
        show_message(f"Engine {name!r} stopped." if name else "No engine is running.", "ok" if name else "info")

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
            show_message(
                f"Attached to the OpenAI-compatible server {words[0]} ({client.engine_info.get('model')}); "
                f"{_share_remote(words[0], client)}",
                "ok",
            )
            return
        show_message(f"Attached to engine {client.name!r} (pid {client.pid}, {client.engine_info.get('model')}).", "ok")

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
            show_message(
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
            show_message(f"Nothing to apply: {unchanged}.", "info")
            return
        show_message(f"Applied in {took * 1e3:.0f} ms: " + "; ".join(parts) + (f"; {unchanged}" if same else ""), "ok")

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
            show_message("No engine is running on this machine.")
            return
        display(_table(["name", "pid", "model", "transport"], rows), raw=True)

    def _engine_help(self, words: list[str]):
        print(_ENGINE_USAGE)

    # %%generate
    @cell_magic
    def generate(self, line: str = "", cell: str = ""):
        """Generate from the cell's prompts (separate them with a line `---`). `%%generate --help`."""
        run, opts = prepare_generate(self.shell, line, cell)
        if run is None:
            return None
        client, cursor = opts["client"], opts["cursor"]
        outputs = run.run(client)
        finish_generate(self.shell, run, outputs, opts, client, cursor)
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
            show_message(n)
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
        ("prefill_attention", "prefill attention"),
        ("prefill_attention_reason", "prefill attention: why"),
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
        if status.get(key) is not None:  # None: nothing to say (no reason needed, no such path here)
            rows.append(("engine", label, status[key]))
    if status.get("memory_mb"):  # what it holds: the weights, their kernels' copies, the KV cache, a draft
        rows.append(("engine", "memory", " · ".join(f"{k} {v:,.0f} MiB" for k, v in status["memory_mb"].items())))
    room = status.get("host_memory")  # on a CPU: what it may still take, and the copies it did without
    if room:
        text = "unbounded" if room["room_mb"] is None else f"{room['room_mb']:,} MiB more ({room['bound']})"
        skipped = ", ".join(f"{kind} ({n} layers)" for kind, n in room["copies_skipped"].items())
        rows.append(("engine", "memory room", text + (f"; copies not made: {skipped}" if skipped else "")))
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
