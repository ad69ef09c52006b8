"""The kernel's engine: which engine the magics and dashboards talk to, started or attached.

One `EngineSession` per process (`get_session()`). It holds the name of the engine to use
(``$WORKBENCH_ENGINE``, set by `workbench lab`, else "default") and one thread-safe client.
Its clients follow the name (`EngineClient(reconnect=True)`): when the engine behind one went
away and a new one holds the name (restarted from another notebook or a terminal), the same
client attaches to it and views are told to re-subscribe; `require()` raises
`NoEngineError` with what to run, or starts the embedded default model.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

ENV_ENGINE = "WORKBENCH_ENGINE"
DEFAULT_NAME = "default"


class NoEngineError(RuntimeError):
    """No engine is running under the session's name (the message says what to run)."""


def _how_to_start(name: str) -> str:
    return (
        f"No engine named {name!r} is running. Start one with `%engine start` (the embedded default "
        f"model; add `--model PATH` for another), attach to another with `%engine connect NAME`, or "
        f"run `workbench serve --name {name}` in a terminal."
    )


class EngineSession:
    def __init__(self, name: str | None = None):
        self.name = name or os.environ.get(ENV_ENGINE) or DEFAULT_NAME
        self._client = None
        self.started_here = False  # this process started the engine (so it stops with the kernel)
        self._lock = threading.RLock()
        self._listeners: list[Callable[[Any], None]] = []

    # -- the client -------------------------------------------------------------------------------
    def client(self, reconnect: bool = True):
        """The live client, following the name to a new engine when the old one went away (the
        client's own `reconnect`); None when no engine holds the name."""
        with self._lock:
            c = self._client
            if c is not None:
                pid = getattr(c, "pid", None)
                if c.alive:  # an engine-process client attaches to the engine now holding its name
                    if getattr(c, "pid", None) != pid:
                        self.started_here = False
                        self._notify(c)  # views re-subscribe: the old engine's events ended
                    return c
                self._drop()
            if not reconnect or not _local_name(self.name):
                return None  # a remote server (a URL) has no name to find it by again
            from ..ipc import connection as conn

            if conn.live_engine(self.name) is None:
                return None
            from ..engines import connect

            new = connect(self.name, timeout=10, reconnect=True)
            self._set(new, started_here=False)
            return new

    def require(self, *, start: bool = False, say: Callable[[str], None] | None = None, **start_kwargs):
        """A live client; with start=True an engine on the embedded default model is started
        (and `say` is told so); otherwise NoEngineError says what to run."""
        c = self.client()
        if c is not None:
            return c
        if not start:
            raise NoEngineError(_how_to_start(self.name))
        if say is not None:
            say(
                f"No engine was running: starting the embedded default model as engine {self.name!r} "
                "(stop it with `%engine stop`)…"
            )
        t0 = time.monotonic()
        c = self.start(**start_kwargs)
        if say is not None:
            say(
                f"Engine {self.name!r} ready: {c.engine_info.get('model')} on {c.engine_info.get('device')} "
                f"(pid {c.pid}) in {time.monotonic() - t0:.1f} s."
            )
        return c

    def start(self, model: str | None = None, *, name: str | None = None, timeout: float = 600.0, **settings):
        """Start an engine process for this kernel (it stops when the kernel exits)."""
        from ..ipc.launch import start_engine

        with self._lock:
            name = name or self.name
            c = start_engine(model, name=name, timeout=timeout, **settings)
            c.reconnect = True  # should it die, follow the name to whichever engine holds it next
            self.name = name
            self._set(c, started_here=True)
            return c

    def connect(self, name: str):
        from ..engines import connect

        with self._lock:
            c = connect(name, timeout=10, **({"reconnect": True} if _local_name(name) else {}))
            self.name = c.name or name
            self._set(c, started_here=False)
            return c

    def stop(self) -> str | None:
        """Shut the engine down; returns its name (None when none was running)."""
        with self._lock:
            c = self.client()
            if c is None:
                return None
            name = c.name
            c.shutdown(timeout=60)
            self._drop()
            return name

    def on_change(self, callback: Callable[[Any], None]) -> Callable[[], None]:
        """Call `callback(client_or_None)` when the session switches engines; returns an undo."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    # -- internals --------------------------------------------------------------------------------
    def _set(self, client, started_here: bool) -> None:
        old = self._client
        self._client = client
        self.started_here = started_here
        if old is not None and old is not client:
            try:
                if old.alive:
                    old.close()
            except Exception:
                pass
        self._notify(client)

    def _drop(self) -> None:
        old, self._client = self._client, None
        self.started_here = False
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        self._notify(None)

    def _notify(self, client) -> None:
        for cb in list(self._listeners):
            try:
                cb(client)
            except Exception:
                pass


def _local_name(name: str) -> bool:
    """Whether `name` names an engine in the runtime dir (not a URL or a connection file)."""
    from ..ipc import connection as conn

    try:
        conn.check_name(name)
    except ValueError:
        return False
    return True


_SESSION: EngineSession | None = None
_SESSION_LOCK = threading.Lock()


def get_session() -> EngineSession:
    """The process-wide session (one kernel, one current engine)."""
    global _SESSION
    with _SESSION_LOCK:
        if _SESSION is None:
            _SESSION = EngineSession()
        return _SESSION


def reset_session(name: str | None = None) -> EngineSession:
    """Forget the current session (tests; a kernel that changes its mind about the name)."""
    global _SESSION
    with _SESSION_LOCK:
        old, _SESSION = _SESSION, EngineSession(name)
    if old is not None and old._client is not None:
        try:
            old._client.close()
        except Exception:
            pass
    return _SESSION
