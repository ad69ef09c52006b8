"""Routing a workload between simulators (models, accelerators or calibrations): short prompts to a
small model, the rest to a large one, each route its own pool; cost and latency per route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..bench.stats import RequestRecord, summarize
from ..bench.workload import BenchRequest
from .simulator import SimResult, Simulator

__all__ = ["RoutedResult", "route", "route_requests"]


class RoutedResult:
    """Each route's `SimResult` and summary, and the whole workload's summary over all routes."""

    def __init__(self, routes: dict[str, SimResult], records: list[RequestRecord]):
        self.routes = routes
        self.records = records

    def summary(self) -> dict[str, Any]:
        out = summarize(self.records, 0.0)
        per = {name: res.summary() for name, res in self.routes.items()}
        tokens = sum(p["output_tokens"] for p in per.values())
        cost = sum((p.get("cost_per_mtok") or 0.0) * p["output_tokens"] for p in per.values())
        out["cost_per_mtok"] = cost / tokens if tokens else None  # each token at its route's price
        out["routes"] = {
            name: {
                "requests": p["requests"],
                "share": p["requests"] / max(len(self.records), 1),
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
    settings: dict[str, Any] | None = None,
    replicas: int | dict[str, int] = 1,
    slo=None,
    record: bool = False,
) -> RoutedResult:
    """Send each request of `workload` to the first route whose predicate takes it (None: every
    request), e.g. short prompts to a small model, the rest to a large one; each route is its own
    simulator (its model, its accelerator or its calibration) and pool of `replicas`."""
    if not routes:
        raise ValueError("routes must hold at least one (name, Simulator, predicate) entry")
    first = routes[0][1]
    requests = first.workload(workload)
    chosen: dict[str, list[BenchRequest]] = {name: [] for name, _, _ in routes}
    for r in requests:
        for name, _, accepts in routes:
            if accepts is None or accepts(r):
                chosen[name].append(r)
                break
        else:
            raise ValueError(f"request {r.index} (prompt {r.prompt_len} tokens) matches no route")
    results: dict[str, SimResult] = {}
    for name, sim, _ in routes:
        if chosen[name]:
            n = replicas.get(name, 1) if isinstance(replicas, dict) else replicas
            results[name] = sim.run(
                route_requests(chosen[name], first, sim), settings, replicas=n, slo=slo, record=record
            )
    records = sorted((rec for res in results.values() for rec in res.records), key=lambda r: r.index)
    return RoutedResult(results, records)
