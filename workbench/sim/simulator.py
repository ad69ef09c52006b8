"""The discrete-event serving simulator: the engine's own `Scheduler` and `BlockManager` on
simulated time, one step-cost model, any number of replicas behind a router.

    sim = workbench.Simulator.calibrate(eng)          # fitted from this engine's steps
    sim = workbench.Simulator(profile="h200")          # a named accelerator's roofline
    res = sim.run(workload={"num_requests": 64, "arrival": "poisson", "rate": 4.0, "seed": 0},
                  settings={"max_num_seqs": 32}, replicas=2, router="least_outstanding")
    res.summary()      # the bench's keys: output_tok_s, ttft_p50_ms, ..., plus goodput and cost
    res.timeline       # a Timeline: the notebook views and Chrome traces draw it like a real run

Each replica is a real `Scheduler` whose clock is the simulated time. A step: the scheduler picks
the batch exactly as in the engine, the cost model gives its duration, every sequence that
reached its end gets a token (`update_from_output`, so blocks fill and are registered for the
prefix cache as in the engine), a request that reached its output length is removed, and the
step goes on the replica's timeline (`Scheduler.record_step`, the engine's own). Requests arrive
between steps, as in the engine. With `speculative` on, decoding sequences get draft tokens as the
engine's proposer attaches them, the scheduler runs verify steps, and each draft token is accepted
with a given probability (`update_after_verify` keeps the accepted ones). A roofline follows the
weights' quantisation; a fit holds for the layout it was measured at. Output lengths are the workload's (greedy, ignore_eos), so a
simulated run and a measured one of the same workload see the same requests.

Layouts: `replicas=N` colocated replicas behind `router` ("round_robin", "least_outstanding" (by
tokens still to compute), "prefix_affinity" (the prompt's first blocks pick the replica unless it
is twice as loaded as the least loaded one), or a function `(request, replicas) -> index`);
`disaggregated=(P, D)`: P prefill replicas produce each request's first token, its KV then travels
(`kv_transfer_gbs`) to one of D decode replicas, which admits it with that KV in place.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..bench.stats import RequestRecord, summarize
from ..bench.workload import BenchRequest, Workload, make_workload
from ..engine.scheduler import Scheduler
from ..engine.sequence import Sequence
from ..sampling_params import SamplingParams
from ..settings import EngineSettings, validate
from ..timeline import Timeline, TimelineRecorder
from .cost import FittedCost, ModelShape, RooflineCost, StepShape, attended, shapes_from_timeline
from .profiles import Profile, get_profile

__all__ = ["ROUTERS", "RoutedResult", "SimResult", "Simulator", "route"]

ROUTERS = ("round_robin", "least_outstanding", "prefix_affinity")
WORKLOAD_KEYS = ("num_requests", "seed", "prompt_len", "output_len", "arrival", "rate")
DEFAULT_WORKLOAD = {"num_requests": 64, "arrival": "poisson", "rate": 4.0, "seed": 0}
DEFAULT_NUM_KV_BLOCKS = 4096
DEFAULT_SPEC_ACCEPTANCE = 0.6  # per draft token, when nothing was measured (an assumption)
_TOKEN = 0  # the id a simulated step "samples" (no model: only counts and lengths matter)


@dataclass
class _Request:
    index: int
    prompt: list[int]
    max_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    replica: int = -1
    preemptions: int = 0
    prefix_hit_tokens: int = 0


class _TransferredKVScheduler(Scheduler):
    """A decode replica's scheduler: a request arrives with its prompt's KV (sent by a prefill
    replica), so once admitted only its new token is computed; a preemption loses that KV."""

    def _admit(self, seq: Sequence, out) -> None:
        super()._admit(seq, out)
        if getattr(seq, "kv_transferred", False):
            seq.num_computed_tokens = max(seq.num_computed_tokens, len(seq) - 1)

    def _preempt(self, seq: Sequence, out, counted: bool = True) -> None:
        seq.kv_transferred = False
        super()._preempt(seq, out, counted)


class _Replica:
    def __init__(self, index: int, settings: EngineSettings, num_blocks: int, cost, *, decode_only: bool = False,
                 timeline_capacity: int = 20_000, acceptance: float = 0.0, seed: int = 0):
        self.index = index
        self.settings = settings
        self.acceptance = acceptance  # chance that each draft token is accepted (speculative decoding)
        self.rng = random.Random(seed + 7919 * index)
        self.t = 0.0
        self.cost = cost
        self.timeline = TimelineRecorder(timeline_capacity)
        cls = _TransferredKVScheduler if decode_only else Scheduler
        self.scheduler = cls(settings, num_blocks, self.timeline, clock=lambda: self.t)
        self.requests: dict[str, _Request] = {}
        self.outstanding = 0  # tokens still to compute over its unfinished requests (the router's load)
        self.busy_s = 0.0
        self.steps = 0
        self.kv_peak = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def add(self, req: _Request, t: float, *, tokens: list[int] | None = None, max_tokens: int | None = None,
            kv_transferred: bool = False) -> None:
        if not self.busy:
            self.t = max(self.t, t)
        rid = str(req.index)
        ids = req.prompt if tokens is None else tokens
        seq = Sequence(rid, ids, SamplingParams(max_tokens=max_tokens or req.max_tokens, ignore_eos=True), t)
        seq.kv_transferred = kv_transferred
        need = self.scheduler.blocks_needed(len(ids) + seq.params.max_tokens)
        if need is not None:
            raise ValueError(f"request {req.index} needs {need} KV blocks ({len(ids)} prompt + {seq.params.max_tokens} "
                             f"output tokens), more than the {self.scheduler.kv_blocks[1]} the cache has")
        self.requests[rid] = req
        req.replica = self.index
        self.outstanding += len(ids) + seq.params.max_tokens
        self.timeline.add_request(t, rid, "arrived", f"prompt_tokens={len(ids)}")
        self.scheduler.add(seq)

    def _propose(self) -> int:
        """Draft tokens for the decoding sequences, as the engine's proposer attaches them (their
        values do not matter here; how many are accepted is drawn at verify)."""
        s = self.settings
        if s.speculative == "off" or not s.kv_cache:
            return 0
        proposed = 0
        for seq in self.scheduler.running:
            room = min(s.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
            if seq.spec_tokens or room < 1 or seq.num_computed_tokens != len(seq) - 1:
                continue
            if self.scheduler.reserve(seq, len(seq) + room):
                seq.spec_tokens = [_TOKEN] * room
                proposed += room
        return proposed

    def _verify(self, seq: Sequence) -> list[int]:
        """A verify's outcome: the leading draft tokens accepted (each with `acceptance`), plus one."""
        accepted = 0
        for _ in seq.spec_tokens:
            if self.rng.random() >= self.acceptance:
                break
            accepted += 1
        return [_TOKEN] * (accepted + 1)

    def step(self) -> list[tuple[_Request, Sequence]]:
        """One engine step at this replica's time; returns the requests it finished."""
        proposed = self._propose()
        sched = self.scheduler.schedule()
        sched.spec_proposed = proposed
        if not sched.scheduled:
            raise RuntimeError(f"replica {self.index} cannot schedule its waiting requests (KV cache too small)")
        prefill = decode = 0
        work = 0.0
        for s in sched.scheduled:
            work += attended(s.seq.num_computed_tokens, s.num_tokens)
            if s.kind == "prefill":
                prefill += s.num_tokens
            else:
                decode += s.num_tokens
        start = self.t
        self.t = end = start + self.cost(StepShape(prefill, decode, len(sched.scheduled), work))
        self.busy_s += end - start
        self.steps += 1
        verified = {i for i, s in enumerate(sched.scheduled) if s.kind == "verify"}
        sampled = {i: _TOKEN for i, s in enumerate(sched.scheduled) if i not in verified
                   and s.seq.num_computed_tokens + s.num_tokens >= len(s.seq.token_ids)}  # `samples`
        self.scheduler.update_from_output(sched, sampled, verified)
        emitted: dict[int, int] = dict.fromkeys(sampled, 1)
        for i in verified:
            seq = sched.scheduled[i].seq
            tokens = self._verify(seq)
            sched.spec_accepted += len(tokens) - 1
            self.scheduler.update_after_verify(seq, len(seq), tokens)
            emitted[i] = len(tokens)
        done = []
        for i, n in emitted.items():
            seq = sched.scheduled[i].seq
            req = self.requests[seq.request_id]
            if not req.token_times:
                self.timeline.add_request(end, seq.request_id, "first_token")
            req.token_times.extend([end] * n)
            self.outstanding -= n
            if seq.num_output_tokens >= seq.params.max_tokens:
                done.append((req, seq))
        used, total = self.scheduler.kv_blocks
        self.kv_peak = max(self.kv_peak, used / total)
        self.scheduler.record_step(sched, start, end, sum(emitted.values()))
        for req, seq in done:
            req.preemptions += seq.metrics.num_preemptions
            req.prefix_hit_tokens += seq.metrics.prefix_hit_tokens
            self.outstanding -= len(seq.prompt_token_ids)
            self.scheduler.remove(seq)
            self.timeline.add_request(end, seq.request_id, "finished", "length")
            del self.requests[seq.request_id]
        return done


class SimResult:
    """A simulated run: per-request records, each replica's timeline, and the bench's summary."""

    run_id: int | None = None  # its row in the run log

    def __init__(self, records: list[RequestRecord], replicas: list[_Replica], *, config: dict[str, Any],
                 requests: list[_Request], wall_s: float):
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
        out.update(run_costs(out["output_tok_s"], prices["price_per_hour"] * len(self.replicas),
                             prices["watts"] * len(self.replicas)))
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


class Simulator:
    """See the module docstring. `cost` is any step-cost model (seconds from a `StepShape`)."""

    def __init__(self, profile: str | Profile | None = "h200", model=None, *, cost=None,
                 settings: dict[str, Any] | None = None, num_kv_blocks: int | None = None, block_size: int = 16,
                 tokenizer=None, vocab_size: int | None = None, device: str | None = None, source: str | None = None):
        self.base_settings = dict(settings or {})
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model if isinstance(model, str) or model is None else str(model)
        if cost is None:
            prof = get_profile(profile or "h200")
            config = _model_config(model)
            self.vocab_size = self.vocab_size or config.vocab_size
            cost = RooflineCost(prof, ModelShape.of(config))
            self.profile = prof
            device = device or prof.device
        else:
            self.profile = get_profile(profile) if isinstance(profile, (str, Profile)) and cost is None else None
        self.cost = cost
        self.device = device or "cpu"
        self.source = source or ("roofline" if isinstance(cost, RooflineCost) else "fitted")

    # -- construction from a live engine ------------------------------------------------------------
    @classmethod
    def calibrate(cls, engine, *, workload: dict[str, Any] | None = None, measure: bool = True) -> Simulator:
        """Fit the step cost from `engine`'s own steps (an `LLM` or an engine-process client):
        with `measure`, a calibration run first (a burst of mixed lengths and a single stream);
        without, the steps already on its timeline."""
        from ..bench.driver import run_workload
        from ..engines import connect

        eng = connect(engine)
        status, settings = eng.status(), eng.settings()
        tok = getattr(eng, "tokenizer", None)
        cursor = eng.timeline(since=1 << 62).cursor if measure else None
        if measure:
            vocab = status.get("vocab_size") or 256
            for w in _calibration_workloads(workload, vocab, status.get("max_model_len") or 2048,
                                            settings.get("max_num_seqs") or 64):
                run_workload(eng, w.requests)
        tl = eng.timeline(since=cursor)
        shapes, seconds = shapes_from_timeline(tl.steps, tl.requests)
        cost = FittedCost.fit(shapes, seconds)
        sim = cls(None, status.get("model"), cost=cost, settings=settings,
                  num_kv_blocks=status.get("num_kv_blocks"), block_size=status.get("block_size") or 16,
                  tokenizer=tok, vocab_size=status.get("vocab_size"), device=str(status.get("device", "cpu")),
                  source="fitted")
        metrics = eng.metrics()
        sim.calibration = {"engine": status.get("model"), "device": status.get("device"),
                           "quantization": settings.get("quantization", "none"),
                           "spec_acceptance_rate": metrics.get("spec_acceptance_rate") or None, **cost.describe()}
        return sim

    calibration: dict[str, Any] | None = None

    @classmethod
    def from_calibration(cls, calibration: dict[str, Any], *, settings: dict[str, Any] | None = None,
                         num_kv_blocks: int | None = None, block_size: int = 16, model=None) -> Simulator:
        """A simulator with a recorded fit (`sim.calibration`, as the run log keeps it)."""
        names = list(calibration["coefficients"])
        from .cost import FEATURES

        if names != list(FEATURES):
            raise ValueError(f"this calibration has the features {names}; this version fits {list(FEATURES)}")
        threshold = calibration.get("threshold_tokens") or (1 << 30)
        cost = FittedCost([float(calibration["coefficients"][k]) for k in FEATURES], threshold, dict(calibration))
        sim = cls(None, model if model is not None else calibration.get("engine"), cost=cost, settings=settings,
                  num_kv_blocks=num_kv_blocks, block_size=block_size, device=str(calibration.get("device") or "cpu"),
                  source="fitted")
        sim.calibration = dict(calibration)
        return sim

    @classmethod
    def latest_fit(cls, model: str | None = None, *, run_log=None) -> Simulator | None:
        """The newest fit recorded on this host (for `model`; None: the embedded default), as a
        simulator; None when there is none. How a measured fit replaces the "cpu" roofline."""
        import socket

        from ..runs import open_log, recording_enabled

        if run_log is None and not recording_enabled():
            return None
        name = model or "smollm2-135m"
        try:
            rows = open_log(run_log).list(kind="simulation", status="completed", limit=200)
        except Exception:
            return None
        for row in rows:
            sim = (row.get("extra") or {}).get("simulator") or {}
            cal = sim.get("calibration")
            if cal and row.get("host") == socket.gethostname() and (cal.get("engine") or row.get("model")) == name:
                try:
                    found = cls.from_calibration(cal, settings=row.get("settings"),
                                                 num_kv_blocks=(row.get("extra") or {}).get("num_kv_blocks"))
                except (ValueError, KeyError, TypeError):
                    continue
                found.source = f"fitted (run log #{row['id']})"
                return found
        return None

    def describe(self) -> dict[str, Any]:
        d = {"source": self.source, "model": self.model_name, "device": self.device,
             "cost": self.cost.describe() if hasattr(self.cost, "describe") else repr(self.cost)}
        if self.calibration:
            d["calibration"] = self.calibration
        return d

    # -- running -------------------------------------------------------------------------------------
    def workload(self, workload=None) -> list[BenchRequest]:
        """The requests of `workload`: the bench's parameters (a dict, as `workbench bench`), a
        `Workload`, a list of `BenchRequest`s, or a recorded `Timeline` (a trace: each request's
        arrival, prompt length and output length replayed, with stand-in token ids)."""
        if isinstance(workload, Workload):
            return list(workload.requests)
        if isinstance(workload, Timeline):
            return trace_requests(workload, self.vocab_size or 49152)
        if isinstance(workload, (list, tuple)) and all(isinstance(r, BenchRequest) for r in workload):
            return list(workload)
        if workload is not None and not isinstance(workload, dict):
            raise TypeError("workload must be a dict of workbench bench parameters, a Workload, a list of "
                            f"BenchRequest or a recorded Timeline; got {type(workload).__name__}")
        kw = {**DEFAULT_WORKLOAD, **(workload or {})}
        unknown = set(kw) - set(WORKLOAD_KEYS)
        if unknown:
            raise ValueError(f"unknown workload key(s) {sorted(unknown)}; allowed: {', '.join(WORKLOAD_KEYS)}")
        if kw.get("arrival") not in ("poisson", "bursty"):
            kw.pop("rate", None)
        for k in ("prompt_len", "output_len"):
            if k in kw:
                kw[k] = tuple(kw[k])
        tok = self.tokenizer if self.tokenizer is not None else _default_tokenizer(self.model_name)
        return list(make_workload(tokenizer=tok, vocab_size=None if tok is not None else self.vocab_size or 49152,
                                  **kw).requests)

    def run(self, workload=None, settings: dict[str, Any] | None = None, replicas: int = 1,
            router: str | Callable = "round_robin", *, disaggregated: tuple[int, int] | None = None,
            kv_transfer_gbs: float = 25.0, slo: dict[str, float] | None = None, spec_acceptance: float | None = None,
            price_per_hour: float | None = None, watts: float | None = None,
            timeline_capacity: int = 20_000, record: bool = True, run_log=None,
            predicts: int | None = None) -> SimResult:
        """Simulate `workload` under `settings` (the engine's names; live ones only matter).
        `record`: write the run log (kind "simulation"; `run_log` a path or RunLog; `predicts`:
        the id of the measured run this predicts, so `workbench runs compare` sets them side by side).
        With `speculative` on, each draft token is accepted with `spec_acceptance` (default: the
        calibrated engine's measured rate, else 0.6, an assumption); a draft model's own forward
        time is not modelled (the n-gram proposer's is nil)."""
        t_wall = time.perf_counter()
        requests = self.workload(workload)
        s = _settings({**self.base_settings, **(settings or {})})
        blocks = self.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS
        _check_router(router)
        slo = _check_slo(slo)
        reqs = [_Request(r.index, list(r.prompt_token_ids), r.max_tokens, r.arrival_s) for r in requests]
        acceptance = self._acceptance(spec_acceptance)
        cost = self._cost_for(s)
        replica = functools.partial(_Replica, timeline_capacity=timeline_capacity, acceptance=acceptance)
        if disaggregated is not None:
            pools = _disaggregated(disaggregated, s, blocks, cost, replica)
            all_replicas = pools[0] + pools[1]
            _run_disaggregated(reqs, pools, router, cost, kv_transfer_gbs, self._kv_bytes_per_token())
        else:
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
                raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
            all_replicas = [replica(i, s, blocks, cost) for i in range(replicas)]
            _run_colocated(reqs, all_replicas, router, self.block_size)
        records = [RequestRecord(r.index, r.arrival, len(r.prompt), [_TOKEN] * len(r.token_times), r.token_times,
                                 r.finished) for r in reqs]
        prof = self.profile
        if price_per_hour is None and prof is not None:
            price_per_hour = prof.price_per_hour
        if watts is None and prof is not None:
            watts = prof.watts
        config = {"settings": s.as_dict() if hasattr(s, "as_dict") else {}, "replicas": len(all_replicas),
                  "router": router if isinstance(router, str) else getattr(router, "__name__", "custom"),
                  "disaggregated": list(disaggregated) if disaggregated else None, "slo": slo,
                  "num_kv_blocks": blocks, "device": self.device, "price_per_hour": price_per_hour, "watts": watts,
                  **self.describe()}
        res = SimResult(records, all_replicas, config=config, requests=reqs, wall_s=time.perf_counter() - t_wall)
        if record:
            res.run_id = self._record(res, _describe_workload(workload, requests), run_log, predicts)
        return res

    def _record(self, res: SimResult, workload: dict[str, Any], run_log, predicts: int | None) -> int | None:
        from ..runs import open_log, recording_enabled, safe_finish, safe_start

        if run_log is None and not recording_enabled():
            return None
        log = open_log(run_log)
        cfg = res.config
        label = f"simulate {self.source}" + (f" {self.profile.name}" if self.profile is not None else "")
        extra = {k: cfg[k] for k in ("replicas", "router", "disaggregated", "slo", "num_kv_blocks")}
        extra.update(simulator=self.describe(), predicts=predicts)
        run_id = safe_start(log, "simulation", label=label, model=self.model_name, device=f"simulated {self.device}",
                            settings=cfg["settings"], workload=workload, extra=extra)
        safe_finish(log, run_id, "completed", metrics=res.summary())
        return run_id

    def replicas_for(self, slo: dict[str, float], workload=None, *, settings=None, router="least_outstanding",
                     attainment: float = 0.99, max_replicas: int = 64) -> int | None:
        """The smallest replica count whose SLO attainment reaches `attainment` (None: not within
        `max_replicas`)."""
        lo, hi, best = 1, max_replicas, None
        while lo <= hi:  # attainment grows with replicas: bisect
            mid = (lo + hi) // 2
            res = self.run(workload, settings, replicas=mid, router=router, slo=slo, timeline_capacity=16,
                           record=False)
            if res.summary()["slo_attainment"] >= attainment:
                best, hi = mid, mid - 1
            else:
                lo = mid + 1
        return best

    def _acceptance(self, given: float | None) -> float:
        if given is not None:
            if not isinstance(given, (int, float)) or isinstance(given, bool) or not 0 <= given <= 1:
                raise ValueError(f"spec_acceptance must be a probability in [0, 1], got {given!r}")
            return float(given)
        measured = (self.calibration or {}).get("spec_acceptance_rate")
        return float(measured) if measured else DEFAULT_SPEC_ACCEPTANCE

    def _cost_for(self, settings: EngineSettings):
        """The step cost under `settings`: a roofline follows the weights' quantisation (fewer bytes
        to read); a fit holds only for the layout it was measured at."""
        q = settings.quantization
        if isinstance(self.cost, RooflineCost):
            if q == "none":
                return self.cost
            config = _model_config(self.model_name)
            return RooflineCost(self.cost.profile, ModelShape.of(config, quantization=q))
        fitted_at = (self.calibration or {}).get("quantization")
        if fitted_at is not None and q != fitted_at:
            raise ValueError(f"this step-cost fit was measured at quantization={fitted_at!r}; simulating "
                             f"quantization={q!r} needs a calibration at {q!r} (or a roofline profile)")
        return self.cost

    def _kv_bytes_per_token(self) -> float:
        model = getattr(self.cost, "model", None)
        if model is not None:
            return model.kv_bytes_per_token
        try:
            return ModelShape.of(_model_config(self.model_name)).kv_bytes_per_token
        except Exception:
            return 2 * 30 * 3 * 64 * 2  # SmolLM2-135M in bf16, when the model is not at hand


# -- routing between models ----------------------------------------------------------------------------
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
        out["routes"] = {name: {"requests": p["requests"], "share": p["requests"] / max(len(self.records), 1),
                                **{k: p[k] for k in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "cost_per_mtok",
                                                     "joules_per_token", "replicas")}} for name, p in per.items()}
        return out


def route(workload, routes: list[tuple[str, Simulator, Callable[[BenchRequest], bool] | None]], *,
          settings: dict[str, Any] | None = None, replicas: int | dict[str, int] = 1, slo=None,
          record: bool = False) -> RoutedResult:
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
            results[name] = sim.run(chosen[name], settings, replicas=n, slo=slo, record=record)
    records = sorted((rec for res in results.values() for rec in res.records), key=lambda r: r.index)
    return RoutedResult(results, records)


# -- the event loops ------------------------------------------------------------------------------------
def _run_colocated(reqs: list[_Request], replicas: list[_Replica], router, block_size: int) -> None:
    arrivals = sorted(reqs, key=lambda r: (r.arrival, r.index))
    pick = _router(router, block_size)
    i, n = 0, len(arrivals)
    while True:
        busy = [r for r in replicas if r.busy]
        nxt = min(busy, key=lambda r: r.t) if busy else None
        if i < n and (nxt is None or arrivals[i].arrival <= nxt.t):
            req = arrivals[i]
            i += 1
            replicas[pick(req, replicas, i - 1)].add(req, req.arrival)
        elif nxt is not None:
            for req, _ in nxt.step():
                req.finished = req.token_times[-1]
        else:
            return


def _disaggregated(layout, settings, blocks, cost, replica) -> tuple[list[_Replica], list[_Replica]]:
    if (not isinstance(layout, (tuple, list)) or len(layout) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in layout)):
        raise ValueError(f"disaggregated must be (prefill replicas, decode replicas), each >= 1; got {layout!r}")
    p, d = layout
    prefill = [replica(i, settings, blocks, cost) for i in range(p)]
    decode = [replica(p + i, settings, blocks, cost, decode_only=True) for i in range(d)]
    return prefill, decode


def _run_disaggregated(reqs, pools, router, cost, kv_gbs: float, kv_bytes_per_token: float) -> None:
    """Prefill replicas produce the first token; after the KV transfer the request decodes on a
    decode replica (which admits it with that KV in place)."""
    if not kv_gbs > 0:
        raise ValueError(f"kv_transfer_gbs must be > 0, got {kv_gbs!r}")
    prefill, decode = pools
    pick_p, pick_d = _router(router, 16), _router("least_outstanding", 16)
    events: list[tuple[float, int, int, _Request]] = [(r.arrival, 0, r.index, r) for r in reqs]  # (t, stage, ...)
    heapq.heapify(events)
    handed = 0
    while True:
        busy = [r for r in prefill + decode if r.busy]
        nxt = min(busy, key=lambda r: r.t) if busy else None
        if events and (nxt is None or events[0][0] <= nxt.t):
            t, stage, _, req = heapq.heappop(events)
            if stage == 0:
                prefill[pick_p(req, prefill, handed)].add(req, t, max_tokens=1)
                handed += 1
            else:
                decode[pick_d(req, decode, 0)].add(req, t, tokens=req.prompt + [_TOKEN],
                                                    max_tokens=req.max_tokens - 1, kv_transferred=True)
        elif nxt is not None:
            for req, _seq in nxt.step():
                if nxt in prefill and req.max_tokens > 1:
                    transfer = len(req.prompt) * kv_bytes_per_token / (kv_gbs * 1e9)
                    heapq.heappush(events, (nxt.t + transfer, 1, req.index, req))
                else:
                    req.finished = req.token_times[-1]
        else:
            return


def _router(router, block_size: int):
    if callable(router):
        return lambda req, replicas, i: int(router(req, replicas))
    if router == "round_robin":
        return lambda req, replicas, i: i % len(replicas)
    if router == "least_outstanding":
        return lambda req, replicas, i: min(range(len(replicas)), key=lambda k: (replicas[k].outstanding, k))
    span = 4 * block_size

    def affinity(req, replicas, i):
        home = hash(tuple(req.prompt[:span])) % len(replicas)
        least = min(range(len(replicas)), key=lambda k: (replicas[k].outstanding, k))
        busy_home = replicas[home].outstanding > 2 * replicas[least].outstanding + 4096
        return least if busy_home else home

    return affinity


def _check_router(router) -> None:
    if not callable(router) and router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)} or a function (request, replicas) -> index; "
                         f"got {router!r}")


def _check_slo(slo) -> dict[str, float]:
    if slo is None:
        return {}
    if not isinstance(slo, dict) or not set(slo) <= {"ttft_ms", "itl_ms"}:
        raise ValueError(f"slo must be a dict with ttft_ms and/or itl_ms; got {slo!r}")
    for k, v in slo.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"slo {k} must be a number > 0, got {v!r}")
    return {k: float(v) for k, v in slo.items()}


def _settings(values: dict[str, Any]) -> EngineSettings:
    s = EngineSettings()
    known = {k: v for k, v in values.items() if v is not None and k in s.trait_names()}
    for name, value in validate(known, s).items():
        setattr(s, name, value)
    return s


def trace_requests(timeline: Timeline, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """A recorded timeline as a workload: every request that arrived and finished in it, at its
    arrival offset, with its prompt length (the "arrived" event) and the tokens its steps produced
    (one per decode step, one when its prefill completed). Token ids are seeded stand-ins, so
    prefix sharing in the original prompts is not replayed."""
    import random

    arrived: dict[str, tuple[float, int]] = {}
    finished: set[str] = set()
    for ev in timeline.requests:
        if ev.kind == "arrived" and ev.detail and ev.detail.startswith("prompt_tokens="):
            arrived[ev.request_id] = (ev.time, int(ev.detail.split("=", 1)[1]))
        elif ev.kind == "finished":
            finished.add(ev.request_id)
    produced: dict[str, int] = {}
    computed: dict[str, int] = {}
    for st in timeline.steps:
        for e in st.batch:
            if e.request_id not in arrived:
                continue
            done = computed.get(e.request_id, 0) + e.num_tokens
            computed[e.request_id] = done
            if e.kind != "prefill" or done >= arrived[e.request_id][1]:
                produced[e.request_id] = produced.get(e.request_id, 0) + 1
    keep = sorted((rid for rid in arrived if rid in finished and produced.get(rid)), key=lambda r: arrived[r][0])
    if not keep:
        raise ValueError("the timeline holds no request that arrived, ran and finished: nothing to replay")
    t0 = arrived[keep[0]][0]
    rng = random.Random(seed)
    return [BenchRequest(i, [rng.randrange(3, vocab_size) for _ in range(arrived[rid][1])], produced[rid],
                         arrived[rid][0] - t0) for i, rid in enumerate(keep)]


def _describe_workload(workload, requests: list[BenchRequest]) -> dict[str, Any]:
    if isinstance(workload, Workload):
        return workload.describe()
    if isinstance(workload, Timeline):
        return {"trace": "timeline", "requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
                "output_tokens": sum(r.max_tokens for r in requests)}
    d = {**DEFAULT_WORKLOAD, **(workload or {})} if isinstance(workload, dict) or workload is None else {}
    return {**{k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}, "requests": len(requests),
            "prompt_tokens": sum(r.prompt_len for r in requests), "output_tokens": sum(r.max_tokens for r in requests)}


def _calibration_workloads(workload, vocab: int, max_len: int, max_num_seqs: int = 64) -> Iterable[Workload]:
    """Steps of every shape the fit needs: a full-width burst of the bench's prompt lengths with
    short outputs (prefill chunks, the widest decode batches over long contexts), a narrow burst,
    and a single stream (small steps)."""
    if workload is not None:
        yield make_workload(vocab_size=vocab, **workload)
        return
    longest = max(32, min(512, max_len // 2 - 64))
    yield make_workload(max(8, min(max_num_seqs, 64)), seed=11, vocab_size=vocab, prompt_len=(32, longest),
                        output_len=(8, 64))
    yield make_workload(8, seed=12, vocab_size=vocab, prompt_len=(32, longest // 2), output_len=(32, 32))
    yield make_workload(1, seed=13, vocab_size=vocab, prompt_len=(32, 64), output_len=(64, 64))


def _model_config(model):
    """The model's config without loading its weights (None: the embedded default)."""
    import json
    from pathlib import Path

    from ..models.config import ModelConfig

    if model is None or (isinstance(model, str) and model in ("smollm2-135m", "default")):
        from ..models.embedded import DEFAULT_MODEL, default_gguf_path, ensure_converted

        path = ensure_converted(default_gguf_path(), DEFAULT_MODEL)
    else:
        path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        from ..models.gguf import read_gguf

        return read_gguf(path)[0]
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path}: no config.json (the simulator needs the model's shape, not its weights)")
    return ModelConfig.from_hf_config(json.loads(cfg.read_text(encoding="utf-8")), str(path))


def _default_tokenizer(model):
    if model not in (None, "smollm2-135m", "default"):
        return None
    try:
        from ..models.embedded import DEFAULT_MODEL, default_gguf_path, ensure_converted
        from ..tokenizer import Tokenizer

        return Tokenizer.from_dir(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    except Exception:  # the default model is not installed: token-id prompts
        return None


