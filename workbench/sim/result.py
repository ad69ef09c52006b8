"""`SimResult`: a simulated run's per-request records, each replica's timeline (and all of them
merged, as a cluster's), and the bench's summary with goodput under the run's SLOs and costs."""

from __future__ import annotations

from typing import Any

from ..bench.stats import RequestRecord, summarize
from ..timeline import Timeline
from .replica import Replica, Request


class SimResult:
    """A simulated run: per-request records, each replica's timeline, and the bench's summary."""

    run_id: int | None = None  # its row in the run log

    def __init__(
        self,
        records: list[RequestRecord],
        replicas: list[Replica],
        *,
        config: dict[str, Any],
        requests: list[Request],
        wall_s: float,
    ):
        self.records, self.replicas, self.config, self.requests = records, replicas, config, requests
        self.wall_s = wall_s
        self._summary: dict[str, Any] | None = None

    @property
    def timeline(self) -> Timeline:
        """Replica 0's timeline (the only one without replicas); `timelines` holds all."""
        return self.replicas[0].timeline.read()

    @property
    def timelines(self) -> list[Timeline]:
        return [r.timeline.read() for r in self.replicas]

    def replica_names(self) -> list[str]:
        """ "r0", "r1", ...; with disaggregation "prefill-0", ..., "decode-0", ...."""
        decode = [r for r in self.replicas if r.decode_only]
        if not decode:
            return [f"r{r.index}" for r in self.replicas]
        prefill = [r for r in self.replicas if not r.decode_only]
        names = {id(r): f"prefill-{i}" for i, r in enumerate(prefill)}
        names.update({id(r): f"decode-{i}" for i, r in enumerate(decode)})
        return [names[id(r)] for r in self.replicas]

    def merged_timeline(self) -> Timeline:
        """Every replica's timeline in one, each event naming its replica, in time order with new
        sequence numbers: what a cluster's merged timeline is, so the same views draw a band per
        replica."""
        import msgspec

        from ..timeline import Timeline

        # a disaggregated request runs on a prefill and then a decode replica: one lane in each
        split = any(r.decode_only for r in self.replicas)
        events = []
        for name, tl in zip(self.replica_names(), self.timelines):

            def rid(r: str, name=name) -> str:
                return f"{r}@{name}" if split else r

            events += [
                (
                    s.start,
                    "steps",
                    msgspec.structs.replace(
                        s,
                        replica=name,
                        batch=[msgspec.structs.replace(b, request_id=rid(b.request_id)) for b in s.batch],
                    ),
                )
                for s in tl.steps
            ]
            events += [
                (q.time, "requests", msgspec.structs.replace(q, replica=name, request_id=rid(q.request_id)))
                for q in tl.requests
            ]
            events += [(c.start, "changes", msgspec.structs.replace(c, replica=name)) for c in tl.changes]
        out = Timeline(steps=[], requests=[], changes=[], cursor=0)
        for seq, (_, field, ev) in enumerate(sorted(events, key=lambda e: e[0]), 1):
            getattr(out, field).append(msgspec.structs.replace(ev, seq=seq))
        out.cursor = len(events)
        return out

    def summary(self) -> dict[str, Any]:
        if self._summary is None:
            self._summary = self._summarize()
        return dict(self._summary)

    def _summarize(self) -> dict[str, Any]:
        from ..tuning.costs import resolve, run_costs

        out = summarize(self.records, 0.0)
        cfg = self.config
        slo = cfg.get("slo") or {}
        met = [_meets(r, slo) for r in self.records]
        duration = out["duration_s"]
        out["goodput_req_s"] = sum(met) / duration if duration > 0 else 0.0
        out["slo_attainment"] = sum(met) / len(met) if met else 0.0
        out["preemptions"] = sum(r.preemptions for r in self.requests)
        out["prefix_hit_tokens"] = sum(r.prefix_hit_tokens for r in self.requests)
        out["kv_usage_peak"] = max(r.kv_peak for r in self.replicas)
        out["engine_steps"] = sum(r.steps for r in self.replicas)
        out["busy_s"] = sum(r.busy_s for r in self.replicas)
        out["replicas"] = len(self.replicas)
        prices = resolve(cfg.get("price_per_hour"), cfg.get("watts"), cfg.get("device", "cuda"))
        out.update(
            run_costs(
                out["output_tok_s"], prices["price_per_hour"] * len(self.replicas), prices["watts"] * len(self.replicas)
            )
        )
        out["simulated_requests_per_wall_s"] = len(self.records) / self.wall_s if self.wall_s > 0 else None
        return out


def _meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    if not slo:
        return r.finished is not None
    ttft = r.ttft
    if ttft is None or ("ttft_ms" in slo and ttft * 1e3 > slo["ttft_ms"]):
        return False
    if "itl_ms" in slo and len(r.token_times) > 1:
        tpot = (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
        if tpot * 1e3 > slo["itl_ms"]:
            return False
    return True
