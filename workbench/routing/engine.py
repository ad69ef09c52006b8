"""`RoutedEngine`: engines serving different models behind one `workbench.Engine`.

Each request is scored by the policy (`policies.py`) and sent to one member, cheapest first; its
chunks come back under the router's request id, its output naming the member (`route`), the score
that decided (`route_score`) and every member that ran it (`route_tried`). A cascade runs the
cheaper member first with its token log-probabilities, holds that answer back (no token of it
reaches the client before its confidence is known), and keeps it, or asks the next member, whose
answer then streams live; both members' work counts in the costs.

Members may be any Engine (in this process, an engine process, an OpenAI-compatible server, a
Ray cluster) or anything `workbench.connect` takes. A member that is down is routed around
(the nearest live member takes its requests, dearer first, and the reason says so); a request a
member fails while serving ends with an error naming the member, and the others go on.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..aio import wait_for
from ..errors import EngineDeadError
from ..interface import Engine, deliver, request_ids
from ..outputs import RequestMetrics, RequestOutput, StreamChunk
from ..timeline import TimelineRecorder
from .decisions import Decisions
from .policies import (
    DEFAULT_THRESHOLDS,
    POLICIES,
    Classifier,
    Draws,
    check_confidence,
    check_policy,
    check_threshold,
    escalates,
    output_confidence,
)
from .shared import RouterFile, connect_member, target_of
from .views import RouterViews

log = logging.getLogger("workbench.routing")

ROUTER_SETTINGS = ("router", "router_threshold", "router_member", "router_confidence")
ALIASES = 100_000  # member request ids remembered for the timeline's lanes

# A caller's policy and threshold for the requests it submits (the HTTP front's RouteLLM model
# names, "router-<policy>-<threshold>"): (policy, threshold) or None for the router's own.
OVERRIDE: contextvars.ContextVar[tuple[str, float] | None] = contextvars.ContextVar("route_override", default=None)


@dataclass
class _Flight:
    """A request on the router: what it asked, where it runs, what it has produced."""

    item: tuple  # (prompt, ids, params) from normalize_batch
    sink: Any
    stream: bool
    chat: bool
    policy: str
    thresholds: list[float]
    level: int = 0  # the member it runs on now
    score: float | None = None
    member_rid: str = ""
    tried: list[str] = field(default_factory=list)
    held: bool = False  # a cascade's answer, kept from the client until its confidence is known
    started: bool = False
    spent: list[RequestOutput] = field(default_factory=list)  # escalated answers (their cost counts)
    arrival: float = 0.0  # when the router took it (time.monotonic): a client's TTFT starts here


class RoutedEngine(Decisions, RouterViews, Engine):
    def __init__(
        self,
        members: dict[str, Any],
        policy: str = "length",
        threshold: float | list[float] | None = None,
        *,
        member: str | None = None,
        confidence: str = "mean",
        classifier: str | Classifier | None = None,
        seed: int = 0,
        name: str = "router",
        timeout: float = 10.0,
        share: bool = False,
    ):
        if not isinstance(members, dict) or len(members) < 2:
            raise ValueError("route() needs a dict of at least two members, name -> Engine, cheapest first")
        self.name = name
        self._lock = threading.RLock()
        self._subs: list = []
        self.members: dict[str, Engine] = {}
        self._attached: set[str] = set()  # members this router connected to (and so detaches on close)
        for key, target in members.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"member names must be non-empty strings, got {key!r}")
            if not isinstance(target, Engine):  # route() connects what connect() takes
                target = connect_member(target, timeout)
                self._attached.add(key)
            self.members[key] = target
        self.names = list(self.members)
        self.policy = check_policy(policy)
        self.thresholds = self._thresholds(DEFAULT_THRESHOLDS[policy] if threshold is None else threshold)
        self.member = self._check_member(member if member is not None else self.names[-1])
        self.how = check_confidence(confidence)
        self.classifier = Classifier.load(classifier) if isinstance(classifier, str) else classifier
        self._draw = Draws(seed)
        self._down: dict[str, str] = {}  # member -> why it is routed around
        self._flights: dict[str, _Flight] = {}
        self._alias: dict[str, str] = {}  # a member's request id -> the router's (its timeline's lanes)
        self._answered: OrderedDict[str, str] = OrderedDict()  # a finished request -> its member (newest last)
        self.routed: Counter = Counter()  # (member, policy) -> requests answered there
        self.escalations = 0
        self.recorder = TimelineRecorder()
        self._cursors: dict[str, int | None] = {n: None for n in self.names}
        self._closed = False
        self._publisher: threading.Thread | None = None
        self._shared: RouterFile | None = None  # the router file (share=True): another process attaches by name
        if share:
            self._shared = RouterFile(name, {n: target_of(e, n) for n, e in self.members.items()})
            self._shared.write(self._routing(), owner=True)
        if policy == "classifier" and self.classifier is None:
            log.info("router %s: classifier policy without a classifier yet: fit() or load one", name)

    def __repr__(self) -> str:
        return f"<RoutedEngine {self.name!r}: {' < '.join(self.names)}, {self.policy} at {self.threshold}>"

    # -- settings -------------------------------------------------------------------------------
    @property
    def threshold(self) -> float | list[float]:
        return self.thresholds[0] if len(set(self.thresholds)) == 1 else list(self.thresholds)

    def _thresholds(self, value) -> list[float]:
        n = len(self.names) - 1
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(
                    f"invalid value {value!r} for setting 'router_threshold': a list needs one threshold per "
                    f"boundary between members ({n}), or give one number for all"
                )
            return [check_threshold(v) for v in value]
        return [check_threshold(value)] * n

    def _check_member(self, name: str) -> str:
        if name not in self.members:
            raise ValueError(f"invalid value {name!r} for setting 'router_member'; allowed: {', '.join(self.names)}")
        return name

    def route_by_model_name(self, model: str) -> tuple[str, float]:
        """RouteLLM's model name `router-<policy>-<threshold>`: route the requests submitted from the
        caller's context (an HTTP request's) by that policy and threshold. Raises ValueError naming
        the form for anything else."""
        policy, _, text = model.removeprefix("router-").partition("-")
        try:
            threshold = check_threshold(float(text))
        except ValueError:
            threshold = None
        if policy not in POLICIES or threshold is None:
            raise ValueError(
                f"the model {model!r} does not exist: a router's form is router-<policy>-<threshold> with policy "
                f"in {', '.join(POLICIES)} and a number (e.g. router-length-64)"
            )
        if policy == "classifier" and self.classifier is None:
            raise ValueError(f"the model {model!r} needs a classifier, and this router has none (fit or load one)")
        OVERRIDE.set((policy, threshold))
        return policy, threshold

    def _routing(self) -> dict:
        """What a shared router's file holds of the routing (every boundary's threshold)."""
        return {**self.router_settings(), "router_threshold": list(self.thresholds)}

    def router_settings(self) -> dict:
        return {
            "router": self.policy,
            "router_threshold": self.threshold,
            "router_member": self.member,
            "router_confidence": self.how,
            "router_members": list(self.names),
        }

    def configure(self, member: str | None = None, **changes: Any) -> dict:
        """`router`, `router_threshold`, `router_member` (fixed), `router_confidence` (cascade: "mean"
        | "min") change the routing from the next request on; other settings go to every member,
        or to the member named. Checked before anything changes. Returns the router's settings and
        the (first changed) member's."""
        mine = {k: changes.pop(k) for k in ROUTER_SETTINGS if k in changes}
        policy = check_policy(mine.get("router", self.policy))
        if "router_threshold" in mine:
            thresholds = self._thresholds(mine["router_threshold"])
        elif policy != self.policy:
            thresholds = self._thresholds(DEFAULT_THRESHOLDS[policy])
        else:
            thresholds = self.thresholds
        chosen = self._check_member(mine.get("router_member", self.member))
        how = mine.get("router_confidence", self.how)
        check_confidence(how)
        if policy == "classifier" and self.classifier is None:
            raise ValueError("the classifier policy needs a classifier: call fit(prompts, labels) or load_classifier()")
        if member is not None and member not in self.members:
            raise KeyError(f"no member named {member!r}; members: {', '.join(self.names)}")
        with self._lock:
            self.policy, self.thresholds, self.member, self.how = policy, thresholds, chosen, how
        if self._shared is not None and mine:
            self._shared.write(self._routing())
        targets = [member] if member is not None else self.names
        out = {}
        for name in targets:
            if changes:
                got = self.members[name].configure(**changes)
                out = out or got
        if not out:
            out = self.members[targets[0]].settings()
        return {**out, **self.router_settings()}

    def settings(self) -> dict:
        self._follow_shared()
        return {**self.members[self.names[0]].settings(), **self.router_settings()}

    def _follow_shared(self) -> None:
        """Take the routing another process sharing this router set (one stat a request)."""
        data = self._shared.changed() if self._shared is not None else None
        if data is None:
            return
        try:
            policy, thresholds = check_policy(data["router"]), self._thresholds(data["router_threshold"])
            member, how = self._check_member(data["router_member"]), data["router_confidence"]
        except (ValueError, KeyError):
            return
        with self._lock:
            self.policy, self.thresholds, self.member, self.how = policy, thresholds, member, how

    def schema(self) -> list[dict]:
        return self.members[self.names[0]].schema()

    # -- routing --------------------------------------------------------------------------------
    def _live_level(self, level: int) -> tuple[int, str | None]:
        """`level`, or the nearest live member (dearer first) when it is down, with the reason."""
        if self.names[level] not in self._down:
            return level, None
        order = list(range(level + 1, len(self.names))) + list(range(level - 1, -1, -1))
        for other in order:
            if self.names[other] not in self._down:
                name = self.names[level]
                return other, f"{name} is down ({self._down[name]})"
        raise EngineDeadError(f"router {self.name!r}: every member is down ({self._down})")

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self, batch, sink, *, chat: bool = False, stream: bool = False, into: list[str] | None = None
    ) -> list[str]:
        self._follow_shared()
        with self._lock:
            policy, thresholds = self.policy, self.thresholds
        override = OVERRIDE.get()
        if override is not None:
            policy, thresholds = override[0], [override[1]] * (len(self.names) - 1)
        rids = [secrets.token_hex(6) for _ in batch]
        if into is not None:
            into.extend(rids)
        for rid, item in zip(rids, batch):
            now = time.monotonic()
            flight = _Flight(item, sink, stream, chat, policy, thresholds, arrival=now)
            self.recorder.add_request(now, rid, "arrived", None, label=None)
            if policy == "cascade":
                flight.level, why = 0, "cascade: the cheapest member answers first"
            else:
                scores = self.scores(item, policy)
                flight.level = self._level(policy, scores, thresholds)
                if scores:
                    flight.score = scores[min(flight.level, len(scores) - 1)]
                why = self._why(policy, flight)
            self._send(rid, flight, why)
        return rids

    def _why(self, policy: str, flight: _Flight) -> str:
        name = self.names[flight.level]
        if policy == "fixed":
            return f"fixed: every request to {name}"
        t = flight.thresholds[min(flight.level, len(flight.thresholds) - 1)]
        word = {"length": "prompt tokens", "classifier": "P(needs a dearer member)", "random": "draw"}[policy]
        return f"{policy}: {word} {flight.score:.4g} vs threshold {t:g} -> {name}"

    def _send(self, rid: str, flight: _Flight, why: str) -> None:
        for name in self.names:  # a member whose engine is gone is routed around before it is tried
            if name not in self._down and not self.members[name].alive:
                self._member_failed(name, EngineDeadError(f"the engine of member {name!r} is gone"))
        try:
            level, detour = self._live_level(flight.level)
        except EngineDeadError as e:
            return deliver(flight.sink, e)
        flight.level = level
        name = self.names[level]
        if detour:
            why += f"; {detour}: {name} takes it"
        prompt, ids, params = flight.item
        last = level == len(self.names) - 1
        flight.held = flight.policy == "cascade" and not last
        if flight.held:
            params = msgspec.structs.replace(params, logprobs=max(params.logprobs or 0, 0))
        flight.tried.append(name)
        with self._lock:
            self._flights[rid] = flight
            ev = self.recorder.add_request(time.monotonic(), rid, "routed", why, label=None)
            ev.replica = name
        try:
            [mrid] = self.members[name].submit(
                [(prompt, ids, params)],
                lambda item, rid=rid: self._on_item(rid, item),
                chat=flight.chat,
                stream=flight.stream and not flight.held,
            )
        except Exception as e:
            flight.tried.pop()
            if self._member_failed(name, e):  # gone before it was sent: the nearest live member takes it
                return self._send(rid, flight, why)
            with self._lock:
                self._flights.pop(rid, None)
            return deliver(flight.sink, _member_error(name, e))
        with self._lock:
            flight.member_rid = mrid
            self._alias[mrid] = rid
            while len(self._alias) > ALIASES:
                self._alias.pop(next(iter(self._alias)))

    def _on_item(self, rid: str, item: Any) -> None:
        with self._lock:
            flight = self._flights.get(rid)
        if flight is None:
            return
        name = self.names[flight.level]
        if isinstance(item, BaseException):
            if self._member_failed(name, item) and not flight.started:  # nothing shown yet: run it elsewhere
                flight.tried.pop()
                return self._send(rid, flight, f"{name} failed before its first token")
            with self._lock:
                self._flights.pop(rid, None)
            return deliver(flight.sink, _member_error(name, item))
        chunk: StreamChunk = item
        if chunk.finish_reason is None:
            if chunk.token_ids_delta:
                flight.started = True
            if flight.stream and not flight.held:
                deliver(flight.sink, msgspec.structs.replace(chunk, request_id=rid))
            return
        out = chunk.output
        if flight.held and out is not None and out.finish_reason != "abort":
            conf = output_confidence(out, self.how)
            flight.score = conf
            t = flight.thresholds[flight.level]
            if escalates("cascade", conf, t):
                flight.spent.append(out)
                self.escalations += 1
                with self._lock:
                    self.recorder.add_request(
                        time.monotonic(), rid, "escalated", f"{name}: confidence {conf:.3g} < {t:g}", label=None
                    ).replica = name
                flight.level += 1
                nxt = self.names[flight.level]
                return self._send(rid, flight, f"cascade: {name}'s confidence {conf:.3g} < {t:g} -> {nxt}")
        with self._lock:
            self._flights.pop(rid, None)
            self._answered[rid] = name
            if len(self._answered) > ALIASES:
                self._answered.popitem(last=False)
            self.routed[(name, flight.policy)] += 1
            self.recorder.add_request(time.monotonic(), rid, "finished", None, label=None).replica = name
        deliver(flight.sink, self._final(rid, flight, chunk))
        if self._shared is not None and not self._closed:  # after the answer is out: a file problem never holds it
            try:
                with self._lock:
                    served = Counter()
                    for (member, _), n in self.routed.items():
                        served[member] += n
                self._shared.write_counts(served)
            except Exception as e:  # noqa: BLE001 - counts shown elsewhere, not the answer
                log.debug("router %s: counts not shared: %s", self.name, e)

    def _final(self, rid: str, flight: _Flight, chunk: StreamChunk) -> StreamChunk:
        """The member's last chunk as the router's: its id, the output naming the route; a held
        (cascade) answer that is kept reaches a streaming client here, all at once."""
        out = chunk.output
        if out is None:
            return msgspec.structs.replace(chunk, request_id=rid)
        wanted = flight.item[2].logprobs
        out = msgspec.structs.replace(
            out,
            metrics=self._client_metrics(flight, out.metrics, len(out.token_ids)),
            request_id=rid,
            route=self.names[flight.level],
            route_policy=flight.policy,
            route_score=flight.score,
            route_tried=list(flight.tried),
            logprobs=out.logprobs if wanted is not None else None,
        )
        if flight.held:
            return StreamChunk(rid, out.text, list(out.token_ids), out.finish_reason, None, out)
        return msgspec.structs.replace(
            chunk, request_id=rid, output=out, logprobs_delta=chunk.logprobs_delta if wanted is not None else None
        )

    @staticmethod
    def _client_metrics(flight: _Flight, m: RequestMetrics, n: int) -> RequestMetrics:
        """A routed answer's times as its client saw them: from the router's arrival, with an
        escalation's wait inside its TTFT; a held (cascade) answer reaches the client all at once,
        now, so all its tokens are timed now. A member's own times stay on the timeline."""
        if flight.held:
            now = time.monotonic()
            return msgspec.structs.replace(
                m, arrival=flight.arrival, first_token=now, token_times=[now] * n, finished=now
            )
        return msgspec.structs.replace(m, arrival=flight.arrival)

    def member_of(self, request_id: str) -> str | None:
        """The member a request runs on now, or answered on (the HTTP front's header, read after the
        stream's first chunk: a short request may have finished by then)."""
        with self._lock:
            flight = self._flights.get(request_id)
            return self.names[flight.level] if flight is not None else self._answered.get(request_id)

    def _member_failed(self, name: str, e: BaseException) -> bool:
        """Mark the member down when `e` means its engine is gone (True); a refusal of one
        request (bad input) leaves it up (False)."""
        from ..errors import EngineConnectError, EngineDrainingError

        if self.members[name].alive and not isinstance(e, (EngineDeadError, EngineConnectError, EngineDrainingError)):
            return False
        with self._lock:
            if name not in self._down:
                self._down[name] = f"{type(e).__name__}: {e}"
                log.warning("router %s: member %s is down (%s); routing around it", self.name, name, e)
        return True

    def abandon(self, request_ids_: list[str]) -> None:
        by_member: dict[str, list[str]] = {}
        with self._lock:
            for rid in request_ids_:
                flight = self._flights.pop(rid, None)
                if flight is not None and flight.member_rid:
                    by_member.setdefault(self.names[flight.level], []).append(flight.member_rid)
        for name, rids in by_member.items():
            self.members[name].abandon(rids)

    def abort(self, request_id: str | Iterable[str]) -> None:
        by_member: dict[str, list[str]] = {}
        with self._lock:
            for rid in request_ids(request_id):
                flight = self._flights.get(rid)
                if flight is not None and flight.member_rid:
                    by_member.setdefault(self.names[flight.level], []).append(flight.member_rid)
        for name, rids in by_member.items():
            self.members[name].abort(rids)

    # -- driving in-process members -------------------------------------------------------------
    def _drive(self) -> bool:
        """Step the in-process members that have work (an engine process steps itself); True if any
        did."""
        stepped = False
        for engine in self.members.values():
            inner = getattr(engine, "engine", None)
            if inner is not None and hasattr(engine, "_step") and inner.has_unfinished_requests():
                engine._step()
                stepped = True
        return stepped

    def poll(self, q, timeout: float):
        import queue as _queue

        deadline = time.monotonic() + timeout
        while q.empty():
            if not self._drive():
                return q.get(timeout=max(0.0, min(0.01, deadline - time.monotonic())) or 1e-3)
            if time.monotonic() >= deadline and q.empty():
                raise _queue.Empty
        return q.get_nowait()

    async def apoll(self, aq):
        import asyncio

        while aq.empty():
            if not self._drive():
                try:
                    return await wait_for(aq.get(), 0.01)
                except asyncio.TimeoutError:
                    continue
            await asyncio.sleep(0)
        return aq.get_nowait()

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities of the tokens under the dearest member (the reference answer's)."""
        return self.members[self.names[-1]].score(token_ids)

    def weights_checksum(self) -> str | None:
        sums = [self.members[n].weights_checksum() for n in self.names]
        return None if None in sums else "+".join(sums)

    def reset_prefix_cache(self) -> int:
        return sum(self.members[n].reset_prefix_cache() for n in self.names if n not in self._down)

    @property
    def alive(self) -> bool:
        return not self._closed and any(e.alive for e in self.members.values())

    def close(self) -> None:
        """Detach from the members this router connected to; members given as engines stay as they are."""
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            self._shared.drop()
        for name in self._attached:
            try:
                self.members[name].close()
            except Exception:
                pass

    def shutdown(self, drain: bool = False, timeout: float = 60.0) -> None:
        """Stop every member (each one's own shutdown), then detach."""
        for engine in self.members.values():
            try:
                engine.shutdown(drain=drain, timeout=timeout)
            except Exception as e:
                log.warning("router %s: a member's shutdown failed: %s", self.name, e)
        if self._shared is not None:
            self._shared.drop()
        self._closed = True


def _member_error(name: str, e: BaseException) -> BaseException:
    """The member's error, its message naming the member (the same type, so callers can catch it)."""
    try:
        return type(e)(f"router member {name!r}: {e}")
    except Exception:
        return RuntimeError(f"router member {name!r}: {type(e).__name__}: {e}")


def attach(name: str, timeout: float = 10.0) -> RoutedEngine:
    """`workbench.connect("router:NAME")`: the router another process shares (its file names the
    members and the policy; a policy changed here is changed there too)."""
    shared, data = RouterFile.read(name)
    router = RoutedEngine(
        data["members"],
        data["router"],
        data["router_threshold"],
        member=data["router_member"],
        confidence=data["router_confidence"],
        name=name,
        timeout=timeout,
    )
    router._shared = shared
    return router
