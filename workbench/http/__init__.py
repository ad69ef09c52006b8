"""The OpenAI-compatible HTTP endpoint: `workbench serve --http HOST:PORT`.

A front process in front of the engine process, not a thread inside it. The front is an
ordinary `EngineClient` of the engine (over the same ZeroMQ protocol as notebooks), running
FastAPI on uvicorn. Why a separate process:

- the engine's step loop keeps the GIL for itself: JSON parsing, SSE framing, tokenizing chat
  templates and Prometheus rendering for many connections run on the front's interpreter and
  never delay a step (the engine-side IO threads already have to share the GIL with it);
- the engine stays reachable by name for notebooks (`workbench.connect(name)`), the
  dashboard and the lab panel at the same time as HTTP clients, and all of them see the same
  requests in the timeline;
- a crash or a stuck connection in the web stack cannot take the engine down, and the front can
  also be put in front of an engine someone started earlier (`python -m workbench.http --attach`).

The cost is one more local hop (msgpack over a Unix socket, well under a millisecond), which
is small next to a decode step. `workbench serve --http` starts both with one command: the
engine as a child process (stopped with the front; it exits by itself if the front is killed).

Modules: `protocol` (request models, errors, SamplingParams mapping), `serving` (what the routes
share and do: auth, checks, tokenizing, engine calls, the drain), `routes/` (the handlers, one
router per concern), `render` (bodies and SSE chunks), `answer` (JSON or a stream, disconnects),
`app` (mounts the routers), `metrics` (Prometheus), `server` (uvicorn, CLI, `start_http_server`).
"""

__all__ = ["HttpServerHandle", "Serving", "create_app", "make_serving", "run_front", "start_http_server"]

_LAZY = {
    "Serving": "serving",
    "create_app": "app",
    "HttpServerHandle": "server",
    "make_serving": "server",
    "run_front": "server",
    "start_http_server": "server",
}


def __getattr__(name: str):  # FastAPI loads on first use, so `workbench --help` stays fast
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
