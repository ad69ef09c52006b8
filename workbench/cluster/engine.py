"""`ClusterEngine`: engine replicas on a Ray cluster behind one `workbench.Engine`.

Each request is routed (`router.Router`) to a replica and sent to its engine process over
ZeroMQ (the replica's `EngineClient`, tcp with CURVE keys); its chunks come back the same way.
The cluster's request ids are the replicas' own, so every replica's timeline, merged here with
the replica named on each event, lines up with the router's decisions (`routed` events).

Faults: a replica whose engine dies is routed around at once. Its requests that had produced no
token yet are sent again to another replica (they lose nothing); those that had end with an
`EngineDeadError` naming the replica. With `restart=True` a dead replica is started again (a
new engine in its actor, or a new actor where the node went away) and taken back into routing.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import EngineDeadError, WorkbenchIPCError
from ..events import Event, EventSubscription
from ..interface import Engine, closed_at_exit, deliver, request_ids
from ..outputs import StreamChunk
from ..reports import combine_metrics
from ..timeline import Timeline, TimelineRecorder
from .router import POLICIES, Router, check_policy

log = logging.getLogger("workbench.cluster")

_handles = closed_at_exit()


@dataclass
class Replica:
    name: str
    client: Any  # its EngineClient
    info: dict  # ReplicaServer.info(): node, pids, connection
    actor: Any = None  # the Ray actor (None: attached, not owned)
    bundle: int = 0
    alive: bool = True
    restarts: int = 0

    def row(self, stats: dict) -> dict:
        s = stats.get(self.name, {})
        return {
            "name": self.name,
            "node": self.info.get("node_ip"),
            "node_id": self.info.get("node_id"),
            "pid": self.info.get("pid"),
            "alive": self.alive and self.client.alive,
            "served": s.get("served", 0),
            "in_flight": s.get("in_flight", 0),
            "queued_tokens": s.get("queued_tokens", 0),
            "restarts": self.restarts,
        }


@dataclass
class _Flight:
    """A request in flight on the cluster: where it runs and what it has produced."""

    item: tuple  # (prompt, ids, params) from normalize_batch
    sink: Any
    stream: bool
    chat: bool
    replica: str
    tried: set
    started: bool = False


class ClusterEngine(Engine):
    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        *,
        router: str = "least_loaded",
        owned: bool = True,
        placement_group=None,
        ray_owned: bool = False,
        restart: bool = False,
        spawn=None,
    ):
        self.name = name
        self._lock = threading.RLock()
        self._subs: list[EventSubscription] = []
        self._replicas: dict[str, Replica] = {r.name: r for r in replicas}
        self.router = Router(list(self._replicas), check_policy(router))
        self.recorder = TimelineRecorder()
        self._flights: dict[str, _Flight] = {}
        self._owned, self._pg, self._ray_owned = owned, placement_group, ray_owned
        self.restart_dead = restart
        self._spawn = spawn  # (bundle index, old replica) -> Replica: a fresh replica where one died
        self._closed = False
        self._feeds: dict[str, list] = {}
        self._published = 0  # the merged timeline's cursor at its last "timeline" event
        self._merged: dict[str, int] = {}  # per replica: the cursor of its timeline merged so far
        self._policy_stamp: int | None = None  # the cluster file's mtime when its router was last read
        for r in replicas:
            self._watch(r)
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"wb-cluster-{name}", daemon=True)
        self._monitor.start()
        _handles.add(self)

    def __repr__(self) -> str:
        live = sum(r.alive for r in self._replicas.values())
        return f"<ClusterEngine {self.name!r}: {live}/{len(self._replicas)} replicas live, router {self.router.policy}>"

    # -- replicas -------------------------------------------------------------------------------
    def replicas(self) -> list[dict]:
        """name, node, pid, alive and requests served of every replica (and in flight, queued tokens)."""
        stats = self.router.stats()
        return [r.row(stats) for r in self._replicas.values()]

    def replica(self, name: str) -> Engine:
        """One replica's engine (its `EngineClient`)."""
        try:
            return self._replicas[name].client
        except KeyError:
            raise KeyError(f"no replica named {name!r}; replicas: {', '.join(self._replicas)}") from None

    def _watch(self, r: Replica) -> None:
        """Merge the replica's timeline, settings and metrics events into this engine's."""
        offset = getattr(r.client, "clock_offset", 0.0)
        self._merged[r.name] = 0  # a restarted replica counts its events afresh

        def on_event(ev: Event) -> None:
            if ev.kind == "timeline":
                self._merge(r.name, ev.data, offset)
                self._publish_timeline()
            else:
                payload = dict(ev.data) if isinstance(ev.data, dict) else {"value": ev.data}
                self._publish(ev.kind, {**payload, "replica": r.name})

        try:
            self._feeds[r.name] = [r.client.on_event(on_event)]
            head = r.client.timeline(since=1 << 62).cursor  # its history before the watch stays its own
            with self._lock:
                self._merged[r.name] = max(self._merged[r.name], head)
        except Exception as e:  # a replica that cannot be watched still serves
            log.warning("replica %s: no events (%s)", r.name, e)

    def _merge(self, replica: str, tl: Timeline, offset: float) -> None:
        """Events past what was merged of this replica (its published feed and `timeline`'s
        catch-up read can bring the same ones, in either order)."""
        with self._lock:
            seen = self._merged.get(replica, 0)
            fresh = Timeline(
                steps=[x for x in tl.steps if x.seq > seen],
                requests=[x for x in tl.requests if x.seq > seen],
                cursor=tl.cursor,
                changes=[x for x in tl.changes if x.seq > seen],
            )
            self.recorder.merge(fresh, replica, offset)
            self._merged[replica] = max([seen, *(x.seq for x in (*fresh.steps, *fresh.requests, *fresh.changes))])

    def _publish(self, kind: str, data: Any) -> None:
        with self._lock:
            subs = list(self._subs)
        ev = Event(kind, time.monotonic(), data)
        for sub in subs:
            sub._deliver(ev)

    def _publish_timeline(self) -> None:
        """What the merged timeline gained since it was last published, to the subscribers."""
        with self._lock:
            data = self.recorder.read(self._published)
            self._published = self.recorder.cursor
        if data.steps or data.requests or data.changes:
            self._publish("timeline", data)

    def _subscribe(self, sub: EventSubscription, timeout: float) -> EventSubscription:
        with self._lock:
            self._subs.append(sub)
        return sub

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self, batch, sink, *, chat: bool = False, stream: bool = False, into: list[str] | None = None
    ) -> list[str]:
        rids = [secrets.token_hex(6) for _ in batch]
        if into is not None:
            into.extend(rids)
        for rid, item in zip(rids, batch):
            self._send(rid, _Flight(item, sink, stream, chat, replica="", tried=set()))
        return rids

    def _send(self, rid: str, flight: _Flight) -> None:
        prompt, ids, params = flight.item
        key = ids if ids is not None else prompt
        n = len(ids) if ids is not None else max(1, len(prompt or "") // 4)  # text: ~4 characters a token
        self._follow_shared_policy()
        while True:
            name, why = self.router.route(key, n, params.max_tokens, exclude=flight.tried, request_id=rid)
            flight.replica = name
            flight.tried.add(name)
            with self._lock:
                self._flights[rid] = flight
                self.recorder.add_request(time.monotonic(), rid, "routed", why, label=None).replica = name
            try:
                self._replicas[name].client.submit(
                    [flight.item],
                    lambda item, rid=rid: self._on_item(rid, item),
                    chat=flight.chat,
                    stream=True,
                    ids=[rid],
                )
                return
            except (EngineDeadError, WorkbenchIPCError) as e:  # gone before it was sent: the next replica
                self._replica_down(name, e)
                self.router.finished(rid)

    def _on_item(self, rid: str, item: Any) -> None:
        with self._lock:
            flight = self._flights.get(rid)
        if flight is None:
            return
        if isinstance(item, BaseException):
            self.router.finished(rid)
            if isinstance(item, (EngineDeadError, WorkbenchIPCError)):
                self._replica_down(flight.replica, item)
                if not flight.started:  # nothing produced yet: run it elsewhere, nothing lost
                    try:
                        return self._send(rid, flight)
                    except RuntimeError as e:
                        item = EngineDeadError(
                            f"request {rid}: replica {flight.replica} failed ({item}) and no "
                            f"other replica can take it ({e})"
                        )
                else:
                    item = EngineDeadError(
                        f"request {rid}: replica {flight.replica} failed while serving it, after "
                        f"its first tokens ({item}); the other replicas go on"
                    )
            with self._lock:
                self._flights.pop(rid, None)
            return deliver(flight.sink, item)
        chunk: StreamChunk = item
        if chunk.token_ids_delta:
            flight.started = True
            self.router.progress(rid, len(chunk.token_ids_delta))
        if chunk.finish_reason is not None:
            self.router.finished(rid)
            with self._lock:
                self._flights.pop(rid, None)
            return deliver(flight.sink, chunk)
        if flight.stream:
            deliver(flight.sink, chunk)

    def abandon(self, request_ids_: list[str]) -> None:
        by_replica: dict[str, list[str]] = {}
        with self._lock:
            for rid in request_ids_:
                flight = self._flights.pop(rid, None)
                if flight is not None:
                    by_replica.setdefault(flight.replica, []).append(rid)
                    self.router.finished(rid)
        for name, rids in by_replica.items():
            self._replicas[name].client.abandon(rids)

    def abort(self, request_id: str | Iterable[str]) -> None:
        by_replica: dict[str, list[str]] = {}
        with self._lock:
            for rid in request_ids(request_id):
                flight = self._flights.get(rid)
                if flight is not None:
                    by_replica.setdefault(flight.replica, []).append(rid)
        for name, rids in by_replica.items():
            self._replicas[name].client.abort(rids)

    # -- control --------------------------------------------------------------------------------
    def _live(self) -> list[Replica]:
        live = [r for r in self._replicas.values() if r.alive]
        if not live:
            raise EngineDeadError(f"cluster {self.name!r}: no replica is alive")
        return live

    def configure(self, replica: str | None = None, **changes: Any) -> dict:
        """Apply `changes` to every live replica one after another (so a re-layout never takes all
        capacity at once), or to the replica named; `router=` switches the routing policy, live.
        Returns the effective settings (of the last replica changed), with `router`."""
        policy = changes.pop("router", None)
        if policy is not None:
            self.router.set_policy(policy)
            _share_policy(self.name, self.router.policy)
        if replica is not None and replica not in self._replicas:
            raise KeyError(f"no replica named {replica!r}; replicas: {', '.join(self._replicas)}")
        targets = [self._replicas[replica]] if replica is not None else self._live()
        out = targets[0].client.settings() if not changes else {}
        for r in targets:
            if changes:
                out = r.client.configure(**changes)
        return {**out, "router": self.router.policy}

    def settings(self) -> dict:
        self._follow_shared_policy()
        return {**self._live()[0].client.settings(), "router": self.router.policy}

    def _follow_shared_policy(self) -> None:
        """The routing policy is the cluster's, not one process's: configure(router=) in any
        process attached to it (a lab panel, another kernel) writes it to the cluster file, and
        every process routes by the file's (one stat a request)."""
        path = _cluster_file(self.name)
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return
        if stamp == self._policy_stamp:
            return
        self._policy_stamp = stamp
        try:
            policy = json.loads(path.read_text()).get("router")
        except (OSError, ValueError):
            return
        if policy in POLICIES and policy != self.router.policy:
            self.router.set_policy(policy)

    def schema(self) -> list[dict]:
        return self._live()[0].client.schema()

    def metrics(self) -> dict:
        """Counts and rates summed over the live replicas, latencies each replica's worst, and
        `per_replica` (each replica's metrics) and `router` (what each was sent)."""
        per = {}
        for r in self._live():
            try:
                per[r.name] = r.client.metrics()
            except (EngineDeadError, WorkbenchIPCError, TimeoutError) as e:
                self._replica_down(r.name, e)
        return {**combine_metrics(per), "per_replica": per, "router": self.router.stats()}

    def status(self) -> dict:
        """The first live replica's status (model, device, kernels...), the cluster's name, router
        and every replica."""
        first = self._live()[0].client.status()
        self._follow_shared_policy()
        return {
            **first,
            "cluster": self.name,
            "router": self.router.policy,
            "routers": list(POLICIES),
            "replicas": self.replicas(),
            "num_replicas": len(self._replicas),
        }

    def timeline(self, since: int | None = None) -> Timeline:
        """The merged timeline, caught up with every live replica first: the replicas publish their
        events a beat after the outputs, and a read right after `generate` returns shows them all."""
        for r in [r for r in self._replicas.values() if r.alive]:
            try:
                tl = r.client.timeline(since=self._merged.get(r.name, 0))
                self._merge(r.name, tl, getattr(r.client, "clock_offset", 0.0))
            except Exception as e:  # a replica going down: its feed and the monitor say so
                log.debug("replica %s: no timeline to catch up on (%s)", r.name, e)
        self._publish_timeline()
        with self._lock:
            return self.recorder.read(since)

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities of the tokens, on the least loaded replica."""
        return self._replicas[self.router.lightest()].client.score(token_ids)

    def reset_prefix_cache(self) -> int:
        return sum(r.client.reset_prefix_cache() for r in self._live())

    def weights_checksum(self) -> str:
        sums = {r.client.weights_checksum() for r in self._live()}
        if len(sums) != 1:
            raise RuntimeError(f"cluster {self.name!r}: replicas hold different weights ({sorted(sums)})")
        return sums.pop()

    # -- faults ---------------------------------------------------------------------------------
    def _replica_down(self, name: str, why: BaseException) -> None:
        r = self._replicas.get(name)
        if r is None or not r.alive:
            return
        r.alive = False
        self.router.set_alive(name, False)
        log.warning("cluster %s: replica %s is down (%s); routing around it", self.name, name, why)
        self._publish("engine", {"state": "replica_down", "replica": name, "reason": str(why)})

    def restart(self, name: str) -> dict:
        """Start a dead (or live) replica again and take it back into routing; its row."""
        r = self._replicas[name]
        if self._spawn is None:
            raise RuntimeError(f"cluster {self.name!r} is attached, not owned: it cannot restart replicas")
        old = r.client
        with self._lock:
            new = self._spawn(r)
            self._replicas[name] = new
            new.restarts = r.restarts + 1
        try:
            old.close()
        except Exception:
            pass
        self._watch(new)
        self.router.set_alive(name, True)
        self._publish("engine", {"state": "replica_up", "replica": name})
        return new.row(self.router.stats())

    def _monitor_loop(self) -> None:
        while not self._closed:
            for r in list(self._replicas.values()):
                if r.alive and not r.client.alive:
                    self._replica_down(r.name, EngineDeadError(f"engine of replica {r.name} is gone"))
                if not r.alive and self.restart_dead and not self._closed:
                    try:
                        self.restart(r.name)
                    except Exception as e:
                        log.warning("cluster %s: restarting replica %s failed: %s", self.name, r.name, e)
            time.sleep(0.5)

    # -- what views read (as from an engine process's client) ----------------------------------
    @property
    def engine_info(self) -> dict:
        """The first live replica's handshake (model, device...) with the cluster's name and size."""
        first = self._live()[0].client
        return {**(first.engine_info or {}), "cluster": self.name, "num_replicas": len(self._replicas)}

    @property
    def pid(self) -> int:
        """This process's (the driver's); each replica's engine pid is in `replicas()`."""
        return os.getpid()

    log_file = None  # each replica's engine has its own log, beside its connection file on its node

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closed and any(r.alive and r.client.alive for r in self._replicas.values())

    def close(self) -> None:
        """Detach (the replicas keep running where this handle does not own them)."""
        if self._closed:
            return
        self._closed = True
        for r in self._replicas.values():
            try:
                r.client.close()
            except Exception:
                pass

    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None:
        """Stop every replica this handle started (their engines, actors and placement group), and
        the local Ray cluster if it started one; an attached handle just detaches."""
        if not self._owned:
            return self.close()
        self._closed = True
        import ray

        stops = []
        for r in self._replicas.values():
            try:
                r.client.shutdown(drain=drain, timeout=timeout)
            except Exception:
                pass
            if r.actor is not None:
                try:
                    stops.append(r.actor.stop.remote())
                except Exception:
                    pass
        try:
            ray.get(stops, timeout=timeout)
        except Exception:
            pass
        for r in self._replicas.values():
            if r.actor is not None:
                try:
                    ray.kill(r.actor)
                except Exception:
                    pass
        if self._pg is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:
                pass
        _remove_cluster_file(self.name)
        if self._ray_owned:
            ray.shutdown()


# -- the cluster file: how another kernel finds the replicas -------------------------------------
def _cluster_file(name: str):
    from ..ipc import connection as conn

    return conn.runtime_dir() / f"cluster-{name}.json"


def write_cluster_file(engine: ClusterEngine, ray_address: str | None) -> None:
    path = _cluster_file(engine.name)
    first = next(iter(engine._replicas.values()))
    data = {
        "name": engine.name,
        "router": engine.router.policy,
        "ray_address": ray_address,
        "owner_pid": os.getpid(),
        "model": (first.client.engine_info or {}).get("model"),
        "replicas": [r.info for r in engine._replicas.values()],
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the replicas' CURVE keys
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)


def _share_policy(name: str, policy: str) -> None:
    path = _cluster_file(name)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no file (a cluster made by hand in a test): nobody else to tell
    data["router"] = policy
    from ..ipc.connection import write_private_json

    write_private_json(path, data)


def list_clusters() -> list[dict]:
    """The clusters started on this machine whose owner still runs (their files, with `path`)."""
    from ..ipc import connection as conn

    return [
        {**data, "path": str(path)}
        for path, data in conn.runtime_json("cluster-*.json")
        if conn.pid_alive(int(data.get("owner_pid") or 0))
    ]


def _remove_cluster_file(name: str) -> None:
    try:
        _cluster_file(name).unlink()
    except OSError:
        pass


def attach(name: str, timeout: float = 10.0) -> ClusterEngine:
    """`workbench.connect("cluster:NAME")`: the cluster another process started, by its file."""
    from ..ipc.client import EngineClient
    from .replica import connection_of

    path = _cluster_file(name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no cluster named {name!r} is running here ({path} is missing); start one with "
            "workbench.cluster.start(name=...)"
        ) from None
    replicas = [
        Replica(info["name"], EngineClient(connection_of(info), timeout=timeout), info) for info in data["replicas"]
    ]
    return ClusterEngine(name, replicas, router=data.get("router", "least_loaded"), owned=False)
