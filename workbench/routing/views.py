"""What a router shows (`RoutedEngine`'s views): requests answered per member, the members'
metrics combined, its status, and one timeline of its decisions with every member's steps, also
published as events so the dashboards and the lab panel follow a router as they follow an engine."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from ..reports import combine_metrics
from ..timeline import Timeline
from .policies import POLICIES

log = logging.getLogger("workbench.routing")

PUBLISH_S = 0.25  # how often subscribed views get the router's new timeline events


class RouterViews:
    """A mixin over the router's members (`members`, `names`, `_down`), its counters (`routed`,
    `escalations`, `_flights`), its `recorder`, `_cursors`, `_alias`, `_subs`, `_shared` and `_lock`."""

    def stats(self) -> dict:
        """Requests answered per member (a shared router: by every process sharing it), each
        member's share, this process's answers per policy, escalations, and the members routed
        around."""
        others = self._shared.others_served() if self._shared is not None else Counter()  # every process's
        with self._lock:
            per = Counter(others)
            for (name, _), n in self.routed.items():
                per[name] += n
            total = sum(per.values())
            return {
                "policy": self.policy,
                "threshold": self.threshold,
                "served": {n: per.get(n, 0) for n in self.names},
                "share": {n: (per.get(n, 0) / total if total else 0.0) for n in self.names},
                "by_policy": {f"{m}/{p}": n for (m, p), n in self.routed.items()},
                "escalations": self.escalations,
                "in_flight": len(self._flights),
                "down": dict(self._down),
            }

    def metrics(self) -> dict:
        per = {}
        for name, engine in self.members.items():
            if name in self._down:
                continue
            try:
                per[name] = engine.metrics()
            except Exception as e:
                self._member_failed(name, e)
        return {**combine_metrics(per), "per_member": per, "router": self.stats()}

    def status(self) -> dict:
        first = self.members[self.names[0]].status()
        rows = []
        for name, engine in self.members.items():
            try:
                model = engine.status().get("model")
            except Exception:
                model = None
            rows.append({"name": name, "model": model, "alive": engine.alive and name not in self._down})
        return {**first, "router": self.policy, "router_name": self.name, "members": rows, "routers": list(POLICIES)}

    def timeline(self, since: int | None = None) -> Timeline:
        """The router's decisions (routed, escalated, finished) with every member's steps and
        request events, each tagged with its member (`replica`)."""
        for name, engine in self.members.items():
            try:
                tl = engine.timeline(since=self._cursors[name])
            except Exception:
                continue
            with self._lock:
                self._cursors[name] = tl.cursor
                self.recorder.merge(tl, name, getattr(engine, "clock_offset", 0.0), rename=self._rename)
        with self._lock:
            return self.recorder.read(since)

    def _rename(self, member_rid: str) -> str:
        return self._alias.get(member_rid, member_rid)

    def _subscribe(self, sub, timeout: float):
        with self._lock:
            self._subs.append(sub)
            if self._publisher is None:  # views attached (a dashboard, the lab panel): feed them
                self._publisher = threading.Thread(target=self._publish_loop, name="wb-router", daemon=True)
                self._publisher.start()
        return sub

    def _publish_loop(self) -> None:
        """The router's timeline (its decisions and the members' steps) and metrics, as events: what
        an engine process publishes, so the same views follow a router."""
        from ..events import Event

        cursor, last_metrics = self.recorder.cursor, 0.0
        while not self._closed:
            time.sleep(PUBLISH_S)
            with self._lock:
                subs = list(self._subs)
            if not subs:
                continue
            events = []
            try:
                tl = self.timeline(since=cursor)
                if tl.steps or tl.requests or tl.changes:
                    cursor = tl.cursor
                    events.append(Event("timeline", time.monotonic(), tl))
                if time.monotonic() - last_metrics >= 1.0:
                    last_metrics = time.monotonic()
                    events.append(Event("metrics", last_metrics, self.metrics()))
            except Exception as e:  # a member gone mid-read: the next round sees it down
                log.debug("router %s: publishing failed: %s", self.name, e)
            for ev in events:
                for sub in subs:
                    sub._deliver(ev)
