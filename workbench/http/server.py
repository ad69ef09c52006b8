"""Running the HTTP front: `workbench serve --http HOST:PORT`, or in a thread from Python.

    workbench serve --http 127.0.0.1:8000 [--api-key KEY] [--served-model-name NAME] [--model M] [--<setting> V]
    python -m workbench.http --attach NAME --http 127.0.0.1:8000      (front an engine already running)

    srv = start_http_server(eng, port=0)          # eng: an EngineClient; serves from a thread
    srv.url  ->  "http://127.0.0.1:40123";  srv.stop()

`workbench serve --http` starts the engine process (`start_engine`, so it is also reachable by
name with `EngineClient.connect(name)`), then serves HTTP in this process until Ctrl-C/SIGTERM,
then shuts the engine down. If this process is killed outright, the engine notices its parent is
gone and exits too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..settings import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUED_CHARS
from .protocol import DEFAULT_MAX_BODY_MB, DEFAULT_READ_TIMEOUT_S

log = logging.getLogger("workbench.http")

ENV_API_KEY = "WORKBENCH_API_KEY"


def parse_host_port(text: str) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' or 'PORT' (host 127.0.0.1); '[::1]:PORT' for IPv6."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
    else:
        host, port_text = "", text
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--http wants HOST:PORT (e.g. 127.0.0.1:8000), got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    return host or "127.0.0.1", port


def load_front_tokenizer(model=None, engine_model_name: str | None = None):
    """The tokenizer of the model the engine serves, for chat templates, token counts and
    logprob token strings in the front; None when it cannot be found (then text prompts are
    tokenized by the engine, and chats are limited to one user message)."""
    from ..models import loader
    from ..tokenizer import Tokenizer

    aliases = {loader.DEFAULT_MODEL, "default"}
    if model is None and engine_model_name not in aliases:
        return None
    if model is None or (isinstance(model, str) and model in aliases and not os.path.exists(model)):
        folder = loader.ensure_converted(loader.default_gguf_path(), loader.DEFAULT_MODEL)
        return Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        import gguf

        from ..models.gguf import gguf_tokenizer

        # Only the tokenizer's metadata is read (the file is memory-mapped, the weights not touched).
        return gguf_tokenizer(gguf.GGUFReader(str(path)))
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    return None


def make_serving(
    engine,
    *,
    model=None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    tokenizer="auto",
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    max_queued_chars: int = DEFAULT_MAX_QUEUED_CHARS,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    open_metrics: bool = False,
):
    from .serving import Serving

    status = engine.status()
    engine_model = status.get("model") or "model"
    if isinstance(served_model_name, str):
        served_model_name = [n.strip() for n in served_model_name.split(",") if n.strip()]
    names = list(served_model_name or [engine_model])
    aliases = [engine_model] + ([os.fspath(model)] if model is not None else [])
    if tokenizer == "auto":  # the engine's own (an engine client has it from the handshake), else found here
        tokenizer = getattr(engine, "tokenizer", None) or load_front_tokenizer(model, engine_model)
        if tokenizer is None:
            log.warning(
                "no tokenizer for %s in the HTTP front: chats are limited to one user message and logprob "
                "tokens are spelled token_id:<id> (pass the model path to fix that)",
                engine_model,
            )
    return Serving(
        engine,
        model_names=names,
        tokenizer=tokenizer,
        max_model_len=status.get("max_model_len"),
        api_key=api_key,
        max_body_bytes=int(max_body_mb * 2**20),
        status=status,
        aliases=aliases,
        max_queued_chars=max_queued_chars,
        read_timeout_s=read_timeout_s,
        open_metrics=open_metrics,
    )


HEADER_TIMEOUT_S = 10.0  # a request's line and headers must all arrive within this, or the connection closes


def _header_timeout_protocol(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all
    arrived `timeout_s` after its first byte (slow-header clients hold a connection and its buffer
    forever otherwise: uvicorn's keep-alive timer restarts on every byte)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:  # a next request begins
                self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)
            super().data_received(data)
            if self._header_timer is not None and self.conn.their_state is not h11.IDLE:  # headers complete
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11


def _uvicorn_server(
    app,
    host: str,
    port: int,
    log_level: str = "info",
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    header_timeout: float = HEADER_TIMEOUT_S,
):
    """A uvicorn server whose first SIGTERM/Ctrl-C drains: it keeps listening, new requests get
    a 503 with Retry-After, running ones go on for up to `drain_timeout` s and are then ended with
    an error event (streams) or a 503, so no client sees a refused connection or a body cut
    short; it exits when none is left. A second signal ends them that way at once; a third
    stops without waiting."""
    import uvicorn

    serving = app.state.serving

    class Server(uvicorn.Server):
        signals = 0

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig: int, frame) -> None:
            self.signals += 1
            loop = getattr(self, "loop", None)
            if loop is None or self.signals > 2:
                self.force_exit = self.should_exit
                self.should_exit = True
            elif self.signals == 1:
                loop.call_soon_threadsafe(lambda: loop.create_task(self.drain()))
            else:
                loop.call_soon_threadsafe(serving.cut_all, "a second signal ended the drain")

        async def drain(self) -> None:
            serving.begin_drain(drain_timeout)
            deadline = time.monotonic() + drain_timeout + 2.0  # the cut answers need a moment
            while serving.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a caught SIGTERM after its graceful shutdown, which would kill this
            # process before it stops the engine; catch the signal and just exit the serve loop.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        # The drain ends every request by its deadline; this is the backstop.
        timeout_graceful_shutdown=drain_timeout + 5,
        timeout_keep_alive=30,
        backlog=2048,
        http=_header_timeout_protocol(header_timeout),
    )
    return Server(config)


def _bound_port(server) -> int:
    for s in getattr(server, "servers", []) or []:
        for sock in getattr(s, "sockets", []) or []:
            return sock.getsockname()[1]
    return server.config.port


class HttpServerHandle:
    """An HTTP front serving from a background thread (`start_http_server`)."""

    def __init__(self, server, thread: threading.Thread, host: str, port: int):
        self.server, self.thread, self.host, self.port = server, thread, host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> HttpServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<HttpServerHandle {self.url}>"


def start_http_server(
    engine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model=None,
    api_key: str | None = None,
    served_model_name=None,
    timeout: float = 30.0,
    log_level: str = "warning",
    header_timeout: float = HEADER_TIMEOUT_S,
) -> HttpServerHandle:
    """Serve `engine` (an EngineClient) over HTTP from a daemon thread of this process (a
    notebook, a test). For production use `workbench serve --http`, a process of its own."""
    from .app import create_app

    serving = make_serving(engine, model=model, served_model_name=served_model_name, api_key=api_key)
    server = _uvicorn_server(create_app(serving), host, port, log_level, header_timeout=header_timeout)
    thread = threading.Thread(target=server.run, name="wb-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    return HttpServerHandle(server, thread, host, _bound_port(server))


# -- command line ---------------------------------------------------------------------------------
def add_http_arguments(parser: argparse.ArgumentParser, *, attach: bool = False) -> None:
    g = parser.add_argument_group("HTTP (OpenAI-compatible API)")
    g.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="also serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics) on HOST:PORT",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${ENV_API_KEY} if set, else none); "
        "other users can read it in the process list: prefer --api-key-file or the variable",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from the first line of PATH (kept out of the process list)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="S",
        help=f"a request body must arrive within S seconds, else 408 (default {DEFAULT_READ_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME[,NAME...]",
        help="model name(s) the API answers to (default: the engine's model name)",
    )
    g.add_argument(
        "--max-request-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request body (default {DEFAULT_MAX_BODY_MB} MiB; larger: 413)",
    )
    g.add_argument("--http-log-level", default="info", help="uvicorn log level (default info)")
    g.add_argument(
        "--metrics-without-key",
        action="store_true",
        help="serve /metrics without the API key (for a scraper that cannot send one; it shows the host's "
        "CPU and memory use)",
    )
    if attach:
        g.add_argument(
            "--attach",
            default=None,
            metavar="NAME",
            help="front an engine that is already running (by name or connection file)",
        )


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $WORKBENCH_API_KEY, else None."""
    if args.api_key:
        return args.api_key
    path = getattr(args, "api_key_file", None)
    if path:
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except OSError as e:
            raise SystemExit(f"workbench: cannot read --api-key-file {path}: {e.strerror}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise SystemExit(f"workbench: --api-key-file {path} is empty")
        return key
    return os.environ.get(ENV_API_KEY) or None


def run_front(args: argparse.Namespace, settings: dict | None = None, start_cluster=None, start_router=None) -> int:
    """`workbench serve --http`: start (or attach to) the engine, serve HTTP until a signal.
    With `--replicas`, `start_cluster` (the CLI passes `workbench.cluster.start`, a layer above
    this one) starts the replicas behind the front; with `--route`, `start_router` (the CLI's)
    starts the members and the router over them."""
    from ..ipc.client import EngineClient
    from ..ipc.launch import start_engine
    from .app import create_app

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = parse_host_port(args.http)
    api_key = api_key_from(args)
    model = getattr(args, "model", None)
    attach = getattr(args, "attach", None)
    replicas = getattr(args, "replicas", None)
    if attach:
        engine = EngineClient.connect(attach)
        owned = False
    elif getattr(args, "route_members", None):
        engine = start_router(args, settings or {})
        owned = True
    elif replicas is not None:
        print(
            f"workbench: starting {replicas} replica(s) on Ray ({args.ray_address or 'a local cluster'})...",
            file=sys.stderr,
            flush=True,
        )
        engine = start_cluster(
            replicas,
            address=args.ray_address,
            name=getattr(args, "name", None),
            router=args.router,
            model=model,
            num_cpus=args.replica_cpus,
            num_gpus=args.replica_gpus,
            **(settings or {}),
        )
        owned = True
    else:
        kw = {k: getattr(args, k) for k in ("name", "transport", "host", "port") if getattr(args, k, None) is not None}
        if getattr(args, "client_timeout", None) is not None:
            kw["client_timeout"] = args.client_timeout
        for opt in ("max_message_mb", "max_queued_chars", "max_queued_tokens", "drain_timeout"):
            if getattr(args, opt, None) is not None:
                kw[opt] = getattr(args, opt)
        print(f"workbench: starting the engine ({model or 'default model'})...", file=sys.stderr, flush=True)
        engine = start_engine(model, **kw, **(settings or {}))
        owned = True
    try:
        routed = getattr(args, "route_members", None)
        tokenizer = "auto"
        if routed:  # the front tokenizes for every member: only where they share one vocabulary
            local = [t for t in routed.values() if not t.startswith(("http://", "https://"))]
            model = local[0] if local and local[0] not in ("default", "smollm2-135m") else None
            if len({m.status().get("vocab_size") for m in engine.members.values()}) != 1:
                tokenizer, model = None, None
        serving = make_serving(
            engine,
            model=model,
            tokenizer=tokenizer,
            served_model_name=args.served_model_name or ("router" if routed else None),
            api_key=api_key,
            max_body_mb=args.max_request_mb,
            max_queued_chars=getattr(args, "max_queued_chars", None) or DEFAULT_MAX_QUEUED_CHARS,
            read_timeout_s=args.request_read_timeout,
            open_metrics=getattr(args, "metrics_without_key", False),
        )
        server = _uvicorn_server(
            create_app(serving),
            host,
            port,
            args.http_log_level,
            drain_timeout=getattr(args, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S),
        )
        watchdog = threading.Thread(target=_watch_engine, args=(engine, server), daemon=True)
        watchdog.start()
        shown = f"[{host}]" if ":" in host else host
        if routed:
            where = f"router over {', '.join(f'{n} ({t})' for n, t in routed.items())}, policy {engine.policy}"
        elif replicas is not None:
            where = f"cluster {engine.name!r} ({len(engine.replicas())} replicas, router {engine.router.policy})"
        else:
            where = f"engine {engine.name!r} (log: {engine.log_file})"
        print(
            f"workbench: {where} serving {serving.model_names[0]!r} on http://{shown}:{port}/v1"
            + (" (API key required)" if api_key else ""),
            file=sys.stderr,
            flush=True,
        )
        server.run()
        if server.started is False:
            print(f"workbench: the HTTP server could not start on {host}:{port}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        if owned:
            engine.shutdown()
        else:
            engine.close()


def _watch_engine(engine, server) -> None:
    """Stop serving when the engine is gone (health would only ever say 503 again)."""
    while not server.should_exit:
        if not engine.alive:
            log.error("the engine is gone; stopping the HTTP server")
            server.should_exit = True
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.http --attach NAME --http HOST:PORT` (or --model M to start one)."""
    from ..ipc.engine_main import add_serve_arguments, settings_from_args

    parser = argparse.ArgumentParser(prog="python -m workbench.http", description="OpenAI-compatible HTTP front.")
    add_serve_arguments(parser)
    add_http_arguments(parser, attach=True)
    args = parser.parse_args(argv)
    if not args.http:
        parser.error("--http HOST:PORT is required")
    try:
        settings = settings_from_args(args)
        parse_host_port(args.http)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return run_front(args, settings)
