"""REST and websocket handlers of the Serving Workbench server extension.

All routes live under ``<base_url>workbench/`` and need an authenticated Jupyter user:

    GET    api/schema                      the settings schema (name, kind, type, values, min/max, help)
    GET    api/engines                     running engines (from connection files)
    POST   api/engines                     start one: {"name", "model", "settings", "timeout"}
    GET    api/engines/<name>              {"status", "settings", "metrics"}
    DELETE api/engines/<name>              stop it (?drain=1 finishes what is in flight)
    GET    api/engines/<name>/settings     effective settings
    PATCH  api/engines/<name>/settings     configure: {"max_num_seqs": 8, ...}; engine errors -> 400
    GET    api/engines/<name>/timeline     ?since=<cursor>
    WS     api/engines/<name>/events       ?rate=<Hz>: a snapshot, then coalesced deltas
    GET    api/runs                        the run log's newest runs (?limit=N), with their headline metrics
    GET    api/runs/compare                ?ids=1,2,...: runs side by side (`workbench.runs.plots.comparison`)
    GET    static/bokeh/<file>             BokehJS from the installed bokeh package

Errors are JSON ``{"message", "type"}`` with the engine's message passed through unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import tornado.web
from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, AuthenticatedFileHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from tornado import websocket

from ..aio import wait_for
from ..events import EVENT_KINDS
from ..settings import STATUS_SETTINGS
from .coalesce import SNAPSHOT_STEPS, EventCoalescer, clamp_rate, finite_or_none, history_window
from .hub import EngineHub

# an engine's name, a Ray cluster's as "cluster:NAME" or a shared router's as "router:NAME" (the
# colon still percent-encoded when matched)
NAME = r"(?P<name>(?:(?:cluster|router)(?::|%3[Aa]))?[A-Za-z0-9][A-Za-z0-9_.-]{0,63})"
STATUS_POLL_S = 1.0  # how often a websocket checks that its engine is still alive


def _error_status(exc: BaseException) -> int:
    from ..errors import EngineConnectError, EngineDeadError, EngineStartError, WorkbenchIPCError

    if isinstance(exc, (ValueError, TypeError, KeyError)):
        return 400
    if isinstance(exc, FileNotFoundError):
        return 404
    if isinstance(exc, FileExistsError):
        return 409
    if isinstance(exc, (EngineDeadError, EngineConnectError)):
        return 503
    if isinstance(exc, TimeoutError):
        return 504
    if isinstance(exc, EngineStartError):
        return 500
    if isinstance(exc, WorkbenchIPCError):
        return 502
    return 500


def _jsonable(value: Any) -> Any:
    return msgspec.to_builtins(value, enc_hook=str)


class BaseHandler(APIHandler):
    @property
    def hub(self) -> EngineHub:
        return self.settings["workbench_hub"]

    def reply(self, value: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(_jsonable(value)))

    def fail(self, exc: BaseException, name: str | None = None) -> None:
        from ..errors import EngineDeadError

        status = _error_status(exc)
        if isinstance(exc, EngineDeadError) and name:
            self.hub.forget(name)
        if status >= 500:
            self.log.warning("workbench: %s: %s", type(exc).__name__, exc)
        message = str(exc) if not isinstance(exc, KeyError) else f"missing {exc}"
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"message": message, "type": type(exc).__name__}))

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError as e:
            raise ValueError(f"request body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise TypeError("request body must be a JSON object")
        return data


class SchemaHandler(BaseHandler):
    @tornado.web.authenticated
    def get(self):
        from ..settings import schema

        self.reply({"settings": schema()})


class EnginesHandler(BaseHandler):
    @tornado.web.authenticated
    def get(self):
        try:
            self.reply({"engines": self.hub.list_engines(), "runtime_dir": self.hub.runtime_dir()})
        except Exception as e:
            self.fail(e)

    @tornado.web.authenticated
    async def post(self):
        try:
            body = self.body()
            unknown = set(body) - {"name", "model", "settings", "timeout"}
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}; expected name, model, settings, timeout")
            settings = body.get("settings") or {}
            if not isinstance(settings, dict):
                raise TypeError("settings must be an object of setting name -> value")
            name = body.get("name") or None
            model = body.get("model") or None
            if name is not None and not isinstance(name, str):
                raise TypeError("name must be a string")
            if model is not None and not isinstance(model, str):
                raise TypeError("model must be a string (a model directory, a .gguf file or an embedded name)")
            client = await self.hub.start(name=name, model=model, settings=settings, timeout=body.get("timeout"))
            status = await client.astatus()
            self.reply({"name": client.name, "status": status}, 201)
        except Exception as e:
            self.fail(e)


class EngineHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self, name: str):
        try:
            client = await self.hub.client(name)
            status, settings, metrics = await asyncio.gather(client.astatus(), client.asettings(), client.ametrics())
            self.reply({"name": name, "status": status, "settings": settings, "metrics": metrics})
        except Exception as e:
            self.fail(e, name)

    @tornado.web.authenticated
    async def delete(self, name: str):
        try:
            drain = self.get_argument("drain", "0").lower() in ("1", "true", "yes")
            await self.hub.stop(name, drain=drain)
            self.reply({"name": name, "state": "stopped"})
        except Exception as e:
            self.fail(e, name)


class SettingsHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self, name: str):
        try:
            client = await self.hub.client(name)
            self.reply({"settings": await client.asettings()})
        except Exception as e:
            self.fail(e, name)

    @tornado.web.authenticated
    async def patch(self, name: str):
        try:
            changes = self.body()
            if not changes:
                raise ValueError('no settings to change; send an object such as {"max_num_seqs": 8}')
            client = await self.hub.client(name)
            # The engine validates (same names and messages as configure() everywhere).
            settings = await client.aconfigure(**changes)
            self.reply({"settings": settings, "changed": sorted(changes)})
        except Exception as e:
            self.fail(e, name)

    post = patch  # for clients that cannot send PATCH


class TimelineHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self, name: str):
        try:
            since_arg = self.get_argument("since", None)
            since = None
            if since_arg not in (None, ""):
                try:
                    since = int(since_arg)
                except ValueError:
                    raise ValueError(f"since must be an integer cursor, got {since_arg!r}") from None
            client = await self.hub.client(name)
            timeline = await client.atimeline(since)
            self.reply(timeline)
        except Exception as e:
            self.fail(e, name)


class EventsSocket(WebSocketMixin, websocket.WebSocketHandler, JupyterHandler):
    """Engine events for one browser view: a snapshot first, then deltas at ``rate`` Hz."""

    @property
    def hub(self) -> EngineHub:
        return self.settings["workbench_hub"]

    @ws_authenticated
    async def get(self, name: str):
        self.engine_name = name
        try:
            self.engine_client = await self.hub.client(name)
        except Exception as e:
            status = _error_status(e)
            raise tornado.web.HTTPError(status, str(e)) from None
        res = super().get(name)
        if res is not None:
            await res

    def open(self, name: str):  # type: ignore[override]
        super().open()
        self.coalescer = EventCoalescer(clamp_rate(self.get_argument("rate", "10")))
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.subscription = None
        self.history: int | None = None
        self.task = asyncio.ensure_future(self._run())

    def on_message(self, message):
        try:
            data = json.loads(message)
        except ValueError:
            return
        if isinstance(data, dict) and "rate" in data:
            self.coalescer.set_rate(data["rate"])
            self.wake()
        if isinstance(data, dict) and "history" in data:  # a wider snapshot: page back in time
            self.history = history_window(data["history"])
            self.wake()

    def on_close(self):
        self.closed = True
        self.wake()
        task = getattr(self, "task", None)
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        sub = getattr(self, "subscription", None)
        if sub is not None:
            sub.close()

    # -- engine side ----------------------------------------------------------------------------
    def _on_event(self, ev) -> None:  # the client's event thread
        data = msgspec.to_builtins(ev.data, enc_hook=str)
        try:
            self.loop.call_soon_threadsafe(self._add, ev.kind, data, ev.time)
        except RuntimeError:  # loop closed
            pass

    def _add(self, kind: str, data: Any, t: float) -> None:
        self.coalescer.add(kind, data, t)
        if kind == "settings" and STATUS_SETTINGS & ((data or {}).get("changes") or {}).keys():
            asyncio.ensure_future(self._status_changed())  # the panel's kernels row follows the change
        self.wake()

    async def _status_changed(self) -> None:
        try:
            status = await self.engine_client.astatus()
        except Exception:  # an engine gone: the liveness check reports it
            return
        self.coalescer.add("status", _jsonable(status))
        self.wake()

    def wake(self) -> None:
        ev = getattr(self, "_wake", None)
        if ev is not None:
            ev.set()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        client = self.engine_client
        try:
            self.subscription = await asyncio.to_thread(client.on_event, self._on_event, EVENT_KINDS)
            if self.closed:
                return
            await self._send(await self._snapshot(client, SNAPSHOT_STEPS))
            last_check = time.monotonic()
            while not self.closed:
                self._wake.clear()
                if self.history is not None:
                    window, self.history = self.history, None
                    await self._send(await self._snapshot(client, window))
                now = time.monotonic()
                if now - last_check >= STATUS_POLL_S:
                    last_check = now
                    if not client.alive:
                        self.coalescer.mark_dead(f"engine {self.engine_name!r} is gone")
                if self.coalescer.due(now):
                    msg = self.coalescer.flush(now, force=True)
                    if msg is not None:
                        await self._send(msg)
                        if msg.get("engine", {}).get("state") in ("stopped", "dead"):
                            break
                    continue
                wait = self.coalescer.next_flush_in(now) if self.coalescer.pending() else STATUS_POLL_S
                try:
                    await wait_for(self._wake.wait(), min(max(wait, 0.001), STATUS_POLL_S))
                except asyncio.TimeoutError:
                    pass
        except websocket.WebSocketClosedError:
            pass
        except Exception as e:
            if not self.closed:
                try:
                    await self._send({"type": "error", "message": str(e), "kind": type(e).__name__})
                except websocket.WebSocketClosedError:
                    pass
        finally:
            if self.subscription is not None:
                self.subscription.close()
            if not client.alive:
                self.hub.forget(self.engine_name, client)
            if not self.closed:
                self.close()

    async def _snapshot(self, client, window: int) -> dict[str, Any]:
        # Only the newest events: read the cursor first (an empty read), then a bounded tail
        # (each step comes with up to a few request events).
        head = await client.atimeline(1 << 62)
        since = max(0, head.cursor - 5 * window)
        status, settings, metrics, timeline = await asyncio.gather(
            client.astatus(), client.asettings(), client.ametrics(), client.atimeline(since)
        )
        first = min([e.seq for e in (*timeline.steps[:1], *timeline.requests[:1])], default=0)
        older = since > 0 and first == since + 1  # the ring buffer goes on before what was read
        return self.coalescer.snapshot(
            engine=self.engine_name,
            status=_jsonable(status),
            settings=_jsonable(settings),
            metrics=_jsonable(metrics),
            timeline=_jsonable(timeline),
            now=time.monotonic(),
            window=window,
            older=older,
        )

    async def _send(self, msg: dict[str, Any]) -> None:
        if self.closed:
            raise websocket.WebSocketClosedError()
        await self.write_message(json.dumps(msg))


def bokeh_static_dir() -> str:
    """BokehJS of the installed bokeh package: the page always gets the matching version."""
    import importlib.util

    spec = importlib.util.find_spec("bokeh")
    if spec is None or not spec.submodule_search_locations:
        return str(Path(__file__).parent / "_missing_bokeh")
    return str(Path(next(iter(spec.submodule_search_locations))) / "server" / "static" / "js")


def bokeh_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bokeh")
    except PackageNotFoundError:
        return None


class BokehFileHandler(AuthenticatedFileHandler):
    """BokehJS files; an unauthenticated request gets 403 (not a redirect to the login page)."""

    def get_login_url(self) -> str:
        raise tornado.web.HTTPError(403)


class InfoHandler(BaseHandler):
    @tornado.web.authenticated
    def get(self):
        from .. import __version__

        self.reply(
            {
                "version": __version__,
                "bokeh": bokeh_version(),
                "bokeh_files": ["bokeh.min.js", "bokeh-widgets.min.js", "bokeh-tables.min.js", "bokeh-api.min.js"],
            }
        )


class RunsHandler(BaseHandler):
    """The run log (`workbench.runs`): the newest runs, for the lab's run-log view."""

    @tornado.web.authenticated
    async def get(self):
        from ..runs import headline, list_runs

        try:
            limit = int(self.get_argument("limit", "50"))
            if not 1 <= limit <= 1000:
                raise ValueError(f"limit must be 1..1000, got {limit}")
            runs = await asyncio.to_thread(list_runs, limit=limit)
            self.reply(
                {
                    "runs": finite_or_none(
                        [
                            {
                                **{
                                    k: r.get(k)
                                    for k in ("id", "kind", "status", "label", "started_at", "model", "device")
                                },
                                "headline": headline(r),
                            }
                            for r in runs
                        ]
                    )
                }
            )
        except Exception as e:
            self.fail(e)


class RunsCompareHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self):
        from ..runs import compare
        from ..runs.plots import comparison

        try:
            text = self.get_argument("ids", "")
            try:
                ids = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"ids must be run ids separated by commas, got {text!r}") from None
            result = await asyncio.to_thread(compare, ids)
            self.reply(finite_or_none(comparison(result)))
        except Exception as e:
            self.fail(e)


def route_patterns(base_url: str) -> list[tuple]:
    def u(path: str) -> str:
        return url_path_join(base_url, "workbench", path)

    return [
        (u("api/info"), InfoHandler),
        (u("api/schema"), SchemaHandler),
        (u("api/engines"), EnginesHandler),
        (u(f"api/engines/{NAME}"), EngineHandler),
        (u(f"api/engines/{NAME}/settings"), SettingsHandler),
        (u(f"api/engines/{NAME}/timeline"), TimelineHandler),
        (u(f"api/engines/{NAME}/events"), EventsSocket),
        (u("api/runs"), RunsHandler),
        (u("api/runs/compare"), RunsCompareHandler),
        (u("static/bokeh/(.*)"), BokehFileHandler, {"path": bokeh_static_dir()}),
        # the same files where bokeh's Resources(mode="server", root_url=...) asks for them: what
        # a kernel's plots load (`workbench.bokehjs.bokeh_resources`)
        (u("bokeh/static/js/(.*)"), BokehFileHandler, {"path": bokeh_static_dir()}),
    ]


def setup_handlers(web_app, hub: EngineHub | None = None) -> EngineHub:
    hub = hub or EngineHub()
    web_app.settings["workbench_hub"] = hub
    web_app.add_handlers(".*$", route_patterns(web_app.settings["base_url"]))
    # kernels this server starts inherit it: their plots load BokehJS from here (offline, and a
    # saved notebook holds a script tag rather than megabytes of inline BokehJS)
    from ..bokehjs import BOKEH_ROOT_ENV

    os.environ[BOKEH_ROOT_ENV] = url_path_join(web_app.settings["base_url"], "workbench", "bokeh") + "/"
    return hub
