"""The engine process's entry point: `python -m workbench.ipc.engine_main` (what `start_engine` runs)
and `workbench serve`: flags (one per setting, from the settings schema), load the model, serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from . import connection as conn
from .protocol import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_MESSAGE_MB,
    DEFAULT_MAX_QUEUED_CHARS,
    DEFAULT_MAX_QUEUED_TOKENS,
    START_FAILED,
)
from .server import EngineServer

log = logging.getLogger("workbench.engine")


# -- command line -------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `workbench serve` (also `python -m workbench.ipc.engine_main`); one flag per setting,
    generated from `workbench.settings.schema()`."""
    from ..settings import add_setting_flags

    parser.add_argument("--model", default=None, help="model: 'smollm2-135m' (default), a HF folder or a .gguf file")
    parser.add_argument("--name", default=None, help="engine name clients connect to (default: 'default' if free)")
    parser.add_argument(
        "--transport",
        choices=["ipc", "tcp"],
        default="ipc",
        help="ipc (default, this machine only) or tcp (always CURVE-encrypted and authenticated)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="tcp: interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="tcp: request port (default: any free port)")
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="abort a client's requests after this long without its heartbeat (default 10)",
    )
    parser.add_argument(
        "--max-message-mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_MB,
        help=f"largest accepted message (default {DEFAULT_MAX_MESSAGE_MB} MiB)",
    )
    parser.add_argument(
        "--max-queued-chars",
        type=int,
        default=DEFAULT_MAX_QUEUED_CHARS,
        metavar="N",
        help="refuse new requests (EngineBusyError) while prompts of more than N characters wait "
        f"to be tokenized (default {DEFAULT_MAX_QUEUED_CHARS:,})",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=DEFAULT_MAX_QUEUED_TOKENS,
        metavar="N",
        help=f"refuse new requests while more than N prompt tokens wait to run (default {DEFAULT_MAX_QUEUED_TOKENS:,})",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, let running requests finish for up to this long, then abort "
        f"them (default {DEFAULT_DRAIN_TIMEOUT_S:g}; a second signal stops at once)",
    )
    parser.add_argument("--log-level", default="INFO", help="engine log level (default INFO)")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-file", default=None, help=argparse.SUPPRESS)
    add_setting_flags(parser, "engine settings (same names as configure(); live ones can change later)")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Typed, validated settings from parsed flags and --settings-json (raises ValueError/TypeError)."""
    from ..settings import settings_from_flags

    data = json.loads(args.settings_json) if getattr(args, "settings_json", None) else {}
    if not isinstance(data, dict):
        raise ValueError("--settings-json must be a JSON object")
    return settings_from_flags(args, data)


def serve(args: argparse.Namespace) -> int:
    """Load the model, serve until shutdown() or SIGTERM/SIGINT, then exit the process
    (code 0; 1 when the engine cannot start). A process entry point: it never returns."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # The IO threads need the GIL for a moment per message; a shorter switch interval keeps a
    # busy step loop from delaying them by 5 ms per hand-over (the "convoy effect").
    sys.setswitchinterval(0.001)
    try:
        settings = settings_from_args(args)
        name = conn.check_name(args.name) if args.name else conn.unique_name()
        holder = conn.live_engine(name)
        if holder is not None and holder.pid != os.getpid():
            raise FileExistsError(
                f"an engine named {name!r} is already running (pid {holder.pid}); connect to "
                f"it with EngineClient.connect({name!r}) or choose another name"
            )
        log.info("engine %r starting (pid %d): loading model %s", name, os.getpid(), args.model or "(default)")
        from ..engine.llm_engine import LLMEngine

        engine = LLMEngine(args.model, **settings)
        server = EngineServer(
            engine,
            name=name,
            transport=args.transport,
            host=args.host,
            port=args.port,
            client_timeout_s=args.client_timeout,
            max_message_mb=args.max_message_mb,
            parent_pid=args.parent_pid,
            log_file=args.log_file,
            max_queued_chars=args.max_queued_chars,
            max_queued_tokens=args.max_queued_tokens,
            drain_timeout_s=args.drain_timeout,
        )
        server.install_signal_handlers()
        server.start()
    except Exception as e:
        # what it was given (a model not there, a bad value, a name taken) says itself in one line
        given = isinstance(e, (ValueError, TypeError, FileNotFoundError, FileExistsError))
        log.error("engine failed to start", exc_info=not given)
        print(f"{START_FAILED} {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        logging.shutdown()
        # Threads or sockets may be half set up; nothing here is worth a clean interpreter exit.
        os._exit(1)
    if sys.stdout.isatty():
        print(
            f"engine {name!r} serving {engine.model_name} (pid {os.getpid()}); connect with "
            f"EngineClient.connect({name!r}); Ctrl-C stops it",
            flush=True,
        )
    server.serve_forever()
    # Sockets are closed and flushed, the connection file is gone: skip the slow interpreter
    # teardown (the OS frees the memory, GPU memory included).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.ipc.engine_main", description="Run a workbench engine.")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
