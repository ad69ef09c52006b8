"""Routing a workload between simulators (models, accelerators or calibrations): short prompts to a
small model, the rest to a large one, each route its own pool; cost and latency per route."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..bench.stats import RequestRecord, summarize
from ..bench.workload import BenchRequest
from .replica import TOKEN, Replica, Request
from .simulator import SimResult, Simulator
from .workloads import describe_workload

__all__ = ["RoutedResult", "route", "route_requests"]


class RoutedResult:
    """Each route's `SimResult` and summary, and the whole workload's summary over all routes: each
    request as its client saw it (a cascade: only the answer kept, its wait included)."""

    def __init__(self, routes: dict[str, SimResult], records: list[RequestRecord], answered: dict[int, str]):
        self.routes = routes
        self.records = records
        self.answered = answered  # request index -> the route whose answer the client got

    def summary(self) -> dict[str, Any]:
        out = summarize(self.records, 0.0)
        per = {name: res.summary() for name, res in self.routes.items()}
        cost = sum((p.get("cost_per_mtok") or 0.0) * p["output_tokens"] for p in per.values())
        # every token computed at its route's price (a cascade's held answers too), over the tokens served
        out["cost_per_mtok"] = cost / out["output_tokens"] if out["output_tokens"] else None
        counts = Counter(self.answered.values())
        out["routes"] = {
            name: {
                "requests": p["requests"],
                "answered": counts[name],
                "share": counts[name] / max(len(self.records), 1),
                **{
                    k: p[k]
                    for k in (
                        "output_tok_s",
                        "ttft_p50_ms",
                        "itl_p50_ms",
                        "cost_per_mtok",
                        "joules_per_token",
                        "replicas",
                    )
                },
            }
            for name, p in per.items()
        }
        return out


def route_requests(requests: list[BenchRequest], first: Simulator, sim: Simulator) -> list[BenchRequest]:
    """`requests` (tokenized for `first`) as `sim`'s model sees them: the same text through its own
    tokenizer when it has another one (a model family's tokenizer changes the prompt lengths)."""
    mine, theirs = sim.text_tokenizer(), first.text_tokenizer()
    if mine is None or theirs is None or mine is theirs:
        return requests
    out = []
    for r in requests:
        text = r.prompt if r.prompt is not None else theirs.decode(r.prompt_token_ids)
        out.append(BenchRequest(r.index, mine.encode(text, add_special_tokens=False), r.max_tokens, r.arrival_s, text))
    return out


def route(
    workload,
    routes: list[tuple[str, Simulator, Callable[[BenchRequest], bool] | None]],
    *,
    escalate: Callable[[BenchRequest, str], bool] | None = None,
    output_len: Callable[[BenchRequest, str], int | None] | None = None,
    shared_host: bool = False,
    settings: dict[str, Any] | None = None,
    replicas: int | dict[str, int] = 1,
    slo=None,
    record: bool = False,
) -> RoutedResult:
    """Send each request of `workload` to the first route whose predicate takes it (None: every
    request), e.g. short prompts to a small model, the rest to a large one; each route is its own
    simulator (its model, its accelerator or its calibration) and pool of `replicas`.

    `escalate(request, name)`: a cascade. When a request finishes on a route, True sends it on to
    the next route, arriving as its held answer is judged; the client gets only the answer kept: a
    held answer all at once at its end, an escalated one with the wait in its TTFT (as
    `workbench.routing`'s cascade serves it). `output_len(request, name)`: the tokens that route
    answers with (None: the workload's), since members answer one prompt at different lengths.
    `shared_host`: the routes' engines share one machine's cores, so their steps take turns (one
    step at a time over all routes), as members in processes on one host do; otherwise each route
    runs on machines of its own."""
    if not routes:
        raise ValueError("routes must hold at least one (name, Simulator, predicate) entry")
    started = time.perf_counter()
    first = routes[0][1]
    requests = first.workload(workload)
    by_index = {r.index: r for r in requests}
    names = [name for name, _, _ in routes]
    if len(set(names)) != len(names):
        raise ValueError(f"route names must be unique; got {names}")
    pools = []
    for name, sim, _ in routes:
        n = replicas.get(name, 1) if isinstance(replicas, dict) else replicas
        s, cost, reps = sim.pool(n, settings)
        tokens = {r.index: r.prompt_token_ids for r in route_requests(requests, first, sim)}
        pools.append(_Pool(name, sim, s, cost, reps, tokens))

    arrivals: list[tuple[float, int, int, int]] = []  # (time, order, route, request index)
    order = itertools.count()
    for r in requests:
        for k, (_, _, accepts) in enumerate(routes):
            if accepts is None or accepts(r):
                heapq.heappush(arrivals, (r.arrival_s, next(order), k, r.index))
                break
        else:
            raise ValueError(f"request {r.index} (prompt {r.prompt_len} tokens) matches no route")

    records: dict[int, RequestRecord] = {}
    answered: dict[int, str] = {}
    host_t = 0.0
    while True:
        busy = [rep for pool in pools for rep in pool.replicas if rep.busy]
        nxt = min(busy, key=lambda rep: rep.t) if busy else None
        at = None if nxt is None else max(nxt.t, host_t) if shared_host else nxt.t
        if arrivals and (at is None or arrivals[0][0] <= at):
            t, _, k, index = heapq.heappop(arrivals)
            req = by_index[index]
            length = output_len(req, names[k]) if output_len is not None else None
            pools[k].add(req, t, length)
            continue
        if nxt is None:
            break
        nxt.t = at
        k, pool = next((k, p) for k, p in enumerate(pools) if nxt in p.replicas)
        held = escalate is not None and k + 1 < len(pools)  # a cascade's answer, judged before it is shown
        for done, _ in nxt.step():
            done.finished = done.token_times[-1]
            req = by_index[done.index]
            if held and escalate(req, pool.name):
                heapq.heappush(arrivals, (done.finished, next(order), k + 1, req.index))
                continue
            times = [done.finished] * len(done.token_times) if held else list(done.token_times)
            records[req.index] = RequestRecord(
                req.index, req.arrival_s, len(done.prompt), [TOKEN] * len(times), times, done.finished
            )
            answered[req.index] = pool.name
        host_t = nxt.t
    results = {
        p.name: p.sim.result(p.requests, p.replicas, p.settings, p.cost, slo=slo, started=started)
        for p in pools
        if p.requests
    }
    if record:
        for p in pools:
            if p.name in results:
                ran = [by_index[r.index] for r in p.requests]
                results[p.name].run_id = p.sim._record(results[p.name], describe_workload(workload, ran), None, None)
    return RoutedResult(results, [records[i] for i in sorted(records)], answered)


class _Pool:
    """One route's replicas on the shared clock, and the requests it ran (an escalated request
    runs on each route it passes, as its own `Request` there)."""

    def __init__(self, name: str, sim: Simulator, settings, cost, replicas: list[Replica], tokens: dict):
        self.name, self.sim, self.settings, self.cost = name, sim, settings, cost
        self.replicas, self.tokens = replicas, tokens
        self.requests: list[Request] = []

    def add(self, req: BenchRequest, t: float, max_tokens: int | None) -> None:
        r = Request(req.index, list(self.tokens[req.index]), max_tokens or req.max_tokens, t)
        self.requests.append(r)
        idle = [rep for rep in self.replicas if not rep.busy]
        rep = idle[0] if idle else min(self.replicas, key=lambda x: x.outstanding)  # least outstanding
        rep.add(r, t)
