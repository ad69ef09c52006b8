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
weights' quantisation; a fit is carried to another layout by this CPU's roofline ratio and says
it is extrapolated. A draft model's forward time is paid per proposing round. Output lengths are
the workload's (greedy, ignore_eos), so a simulated run and a measured one of the same workload
see the same requests.

Layouts: `replicas=N` colocated replicas behind `router`: a cluster's policy ("round_robin",
"least_loaded", "prefix_affinity"), decided by the same `workbench.cluster.router.Router` a
`ClusterEngine` routes with; "least_outstanding" (prompt and output tokens of unfinished requests);
or a function `(request, replicas) -> index`;
`disaggregated=(P, D)`: P prefill replicas produce each request's first token, its KV then travels
(`kv_transfer_gbs`) to one of D decode replicas, which admits it with that KV in place.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

from ..bench.stats import RequestRecord
from ..bench.workload import BenchRequest, Workload, make_workload
from ..settings import EngineSettings, validate
from ..timeline import Timeline
from .cost import FittedCost, ModelShape, RescaledCost, RooflineCost, shapes_from_timeline
from .profiles import Profile, get_profile
from .replica import (
    ROUTERS,
    TOKEN,
    Replica,
    Request,
    check_router,
    disaggregated_pools,
    run_colocated,
    run_disaggregated,
)
from .result import SimResult
from .workloads import (
    DEFAULT_WORKLOAD,
    WORKLOAD_KEYS,
    calibration_workloads,
    default_tokenizer,
    describe_workload,
    model_config,
    trace_requests,
)

__all__ = ["ROUTERS", "SimResult", "Simulator"]

DEFAULT_NUM_KV_BLOCKS = 4096
DEFAULT_SPEC_ACCEPTANCE = 0.6  # per draft token, when nothing was measured (an assumption)


class Simulator:
    """See the module docstring. `cost` is any step-cost model (seconds from a `StepShape`)."""

    def __init__(
        self,
        profile: str | Profile | None = "h200",
        model=None,
        *,
        cost=None,
        settings: dict[str, Any] | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        tokenizer=None,
        vocab_size: int | None = None,
        device: str | None = None,
        source: str | None = None,
    ):
        self.base_settings = dict(settings or {})
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model if isinstance(model, str) or model is None else str(model)
        self._shapes: dict[tuple, ModelShape] = {}
        self._cpu_profile: Profile | None = None
        if cost is None:
            prof = get_profile(profile or "h200")
            config = model_config(model)
            self.vocab_size = self.vocab_size or config.vocab_size
            cost = RooflineCost(prof, ModelShape.of(config))
            self.profile = prof
            device = device or prof.device
        else:
            self.profile = None  # a given cost model: no profile behind it
        self.cost = cost
        self.device = device or "cpu"
        self.source = source or ("roofline" if isinstance(cost, RooflineCost) else "fitted")

    def _contexts(self) -> tuple[float | None, float | None]:
        """The model's attention and time contexts, for the scheduler's budget and step-time target
        as the engine's counts them ((None, None) where the model cannot be read here)."""
        if not hasattr(self, "_ctx"):
            from ..engine.scheduler import attention_context_of, time_context_of

            try:
                config = model_config(self.model_name)
                self._ctx = (attention_context_of(config), time_context_of(config))
            except Exception:
                self._ctx = (None, None)
        return self._ctx

    # -- construction from a live engine ------------------------------------------------------------
    @classmethod
    def calibrate(
        cls,
        engine,
        *,
        workload: dict[str, Any] | None = None,
        measure: bool = True,
        since: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> Simulator:
        """Fit the step cost from `engine`'s own steps (an `LLM` or an engine-process client):
        with `measure`, a calibration run first (a burst of mixed lengths and a single stream);
        without, the steps already on its timeline, those after the cursor `since` if given
        (a run it served: a replica sharing a machine is best fitted on traffic like the one to
        predict, where its neighbours load it as they will then; notebooks/10-cluster.ipynb).
        `progress` (e.g. `print`) is told each part of the run as it starts and how long it
        took: a calibration takes a minute or two."""
        from ..bench.driver import run_workload
        from ..engines import connect

        eng = connect(engine)
        status, settings = eng.status(), eng.settings()
        tok = getattr(eng, "tokenizer", None)
        if measure and since is not None:
            raise ValueError("since= picks steps already recorded: pass it with measure=False")
        cursor = eng.timeline(since=1 << 62).cursor if measure else since
        if measure:
            vocab = status.get("vocab_size") or 256
            parts = list(
                calibration_workloads(
                    workload, vocab, status.get("max_model_len") or 2048, settings.get("max_num_seqs") or 64
                )
            )
            started = time.perf_counter()
            for i, w in enumerate(parts, 1):
                if progress is not None:
                    prompt = sum(r.prompt_len for r in w.requests)
                    progress(
                        f"calibrating {i}/{len(parts)}: {len(w.requests)} request(s), {prompt} prompt tokens "
                        f"({time.perf_counter() - started:.0f} s so far)"
                    )
                run_workload(eng, w.requests)
            if progress is not None:
                progress(f"calibrated in {time.perf_counter() - started:.0f} s")
        tl = eng.timeline(since=cursor)
        shapes, seconds = shapes_from_timeline(tl.steps, tl.requests)
        cost = FittedCost.fit(shapes, seconds)
        sim = cls(
            None,
            status.get("model"),
            cost=cost,
            settings=settings,
            num_kv_blocks=status.get("num_kv_blocks"),
            block_size=status.get("block_size") or 16,
            tokenizer=tok,
            vocab_size=status.get("vocab_size"),
            device=str(status.get("device", "cpu")),
            source="fitted",
        )
        metrics = eng.metrics()
        sim.calibration = {
            "engine": status.get("model"),
            "device": status.get("device"),
            "quantization": settings.get("quantization", "none"),
            "spec_acceptance_rate": metrics.get("spec_acceptance_rate") or None,
            **cost.describe(),
        }
        return sim

    calibration: dict[str, Any] | None = None

    @classmethod
    def pooled(cls, sims: list[Simulator]) -> Simulator:
        """One fit over the steps of several calibrations of one engine, made at different moments:
        a shared host's speed drifts by 10-20% over minutes, and one calibration sees one moment
        of it (docs/benchmarks.md, issue 16). The newest calibration gives the settings."""
        if not sims:
            raise ValueError("pooled needs at least one calibrated Simulator")
        cals = [s.calibration for s in sims]
        if any(c is None or not isinstance(s.cost, FittedCost) for s, c in zip(sims, cals)):
            raise ValueError("pooled takes simulators made by Simulator.calibrate")
        layouts = {tuple(c.get(k) for k in ("engine", "device", "quantization")) for c in cals}
        if len(layouts) > 1:
            raise ValueError(f"pooled calibrations must share engine, device and quantization; got {sorted(layouts)}")
        last = sims[-1]
        cost = FittedCost.pooled([s.cost for s in sims])
        sim = cls(
            None,
            last.model_name,
            cost=cost,
            settings=last.base_settings,
            num_kv_blocks=last.num_kv_blocks,
            block_size=last.block_size,
            tokenizer=last.tokenizer,
            vocab_size=last.vocab_size,
            device=last.device,
            source="fitted",
        )
        sim.calibration = {**cals[-1], **cost.describe(), "calibrations": sum(c.get("calibrations", 1) for c in cals)}
        return sim

    @classmethod
    def from_calibration(
        cls,
        calibration: dict[str, Any],
        *,
        settings: dict[str, Any] | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        model=None,
    ) -> Simulator:
        """A simulator with a recorded fit (`sim.calibration`, as the run log keeps it)."""
        names = list(calibration["coefficients"])
        from .cost import FEATURES

        if names != list(FEATURES):
            raise ValueError(f"this calibration has the features {names}; this version fits {list(FEATURES)}")
        threshold = calibration.get("threshold_tokens") or (1 << 30)
        cost = FittedCost([float(calibration["coefficients"][k]) for k in FEATURES], threshold, dict(calibration))
        sim = cls(
            None,
            model if model is not None else calibration.get("engine"),
            cost=cost,
            settings=settings,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            device=str(calibration.get("device") or "cpu"),
            source="fitted",
        )
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
                    found = cls.from_calibration(
                        cal, settings=row.get("settings"), num_kv_blocks=(row.get("extra") or {}).get("num_kv_blocks")
                    )
                except (ValueError, KeyError, TypeError):
                    continue
                found.source = f"fitted (run log #{row['id']})"
                return found
        return None

    def describe(self) -> dict[str, Any]:
        d = {
            "source": self.source,
            "model": self.model_name,
            "device": self.device,
            "cost": self.cost.describe() if hasattr(self.cost, "describe") else repr(self.cost),
        }
        if self.calibration:
            d["calibration"] = self.calibration
        return d

    # -- running -------------------------------------------------------------------------------------
    def text_tokenizer(self):
        """The tokenizer English prompts are cut with: the calibrated engine's, else the model's
        (the embedded default's for the named accelerators)."""
        return self.tokenizer if self.tokenizer is not None else default_tokenizer(self.model_name)

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
            raise TypeError(
                "workload must be a dict of workbench bench parameters, a Workload, a list of "
                f"BenchRequest or a recorded Timeline; got {type(workload).__name__}"
            )
        kw = {**DEFAULT_WORKLOAD, **(workload or {})}
        unknown = set(kw) - set(WORKLOAD_KEYS)
        if unknown:
            raise ValueError(f"unknown workload key(s) {sorted(unknown)}; allowed: {', '.join(WORKLOAD_KEYS)}")
        if kw.get("arrival") not in ("poisson", "bursty"):
            kw.pop("rate", None)
        for k in ("prompt_len", "output_len"):
            if k in kw:
                kw[k] = tuple(kw[k])
        tok = self.text_tokenizer()
        return list(
            make_workload(
                tokenizer=tok, vocab_size=None if tok is not None else self.vocab_size or 49152, **kw
            ).requests
        )

    def run(
        self,
        workload=None,
        settings: dict[str, Any] | None = None,
        replicas: int = 1,
        router: str | Callable = "round_robin",
        *,
        disaggregated: tuple[int, int] | None = None,
        kv_transfer_gbs: float = 25.0,
        slo: dict[str, float] | None = None,
        spec_acceptance: float | None = None,
        price_per_hour: float | None = None,
        watts: float | None = None,
        timeline_capacity: int = 20_000,
        record: bool = True,
        run_log=None,
        predicts: int | None = None,
    ) -> SimResult:
        """Simulate `workload` under `settings` (the engine's names; live ones only matter).
        `record`: write the run log (kind "simulation"; `run_log` a path or RunLog; `predicts`:
        the id of the measured run this predicts, so `workbench runs compare` sets them side by side).
        With `speculative` on, each draft token is accepted with `spec_acceptance` (default: the
        calibrated engine's measured rate, else 0.6, an assumption); a draft model's forward time
        is added per proposing round (the n-gram proposer's is nil). A fit asked for a layout it was
        not measured at (another quantisation, a draft model) is carried there by this CPU's
        roofline ratio and the summary says so (`RescaledCost`)."""
        t_wall = time.perf_counter()
        requests = self.workload(workload)
        check_router(router)
        slo = _check_slo(slo)
        reqs = [Request(r.index, list(r.prompt_token_ids), r.max_tokens, r.arrival_s) for r in requests]
        if disaggregated is not None:
            s, cost, replica = self.replica_factory(settings, spec_acceptance, timeline_capacity)
            blocks = self.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS
            pools = disaggregated_pools(disaggregated, s, blocks, cost, replica)
            all_replicas = pools[0] + pools[1]
            run_disaggregated(reqs, pools, router, cost, kv_transfer_gbs, self._kv_bytes_per_token())
        else:
            s, cost, all_replicas = self.pool(replicas, settings, spec_acceptance, timeline_capacity)
            run_colocated(reqs, all_replicas, router)
        res = self.result(
            reqs,
            all_replicas,
            s,
            cost,
            router=router,
            disaggregated=disaggregated,
            slo=slo,
            price_per_hour=price_per_hour,
            watts=watts,
            started=t_wall,
        )
        if record:
            res.run_id = self._record(res, describe_workload(workload, requests), run_log, predicts)
        return res

    def replica_factory(self, settings, spec_acceptance: float | None = None, timeline_capacity: int = 20_000):
        """(settings, step cost, `Replica(index, settings, blocks, cost)` with this simulator's
        acceptance, draft cost and attention context bound)."""
        s = _settings({**self.base_settings, **(settings or {})})
        replica = functools.partial(
            Replica,
            timeline_capacity=timeline_capacity,
            acceptance=self._acceptance(spec_acceptance),
            draft_cost=self._draft_cost(s),
            contexts=self._contexts(),
        )
        return s, self._cost_for(s), replica

    def pool(self, replicas: int, settings=None, spec_acceptance: float | None = None, timeline_capacity: int = 20_000):
        """(settings, step cost, `replicas` fresh colocated replicas of this model)."""
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        s, cost, replica = self.replica_factory(settings, spec_acceptance, timeline_capacity)
        blocks = self.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS
        return s, cost, [replica(i, s, blocks, cost) for i in range(replicas)]

    def result(
        self,
        reqs: list[Request],
        all_replicas: list[Replica],
        s: EngineSettings,
        cost,
        *,
        router="round_robin",
        disaggregated=None,
        slo=None,
        price_per_hour: float | None = None,
        watts: float | None = None,
        started: float | None = None,
    ) -> SimResult:
        """The `SimResult` of replicas that ran `reqs` (each request's record as it ran there)."""
        records = [
            RequestRecord(r.index, r.arrival, len(r.prompt), [TOKEN] * len(r.token_times), r.token_times, r.finished)
            for r in reqs
        ]
        slo = _check_slo(slo)
        blocks = self.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS
        prof = self.profile
        if price_per_hour is None and prof is not None:
            price_per_hour = prof.price_per_hour
        if watts is None and prof is not None:
            watts = prof.watts
        config = {
            "settings": s.as_dict() if hasattr(s, "as_dict") else {},
            "replicas": len(all_replicas),
            "router": router if isinstance(router, str) else getattr(router, "__name__", "custom"),
            "disaggregated": list(disaggregated) if disaggregated else None,
            "slo": slo,
            "num_kv_blocks": blocks,
            "device": self.device,
            "price_per_hour": price_per_hour,
            "watts": watts,
            **self.describe(),
        }
        if cost is not self.cost:  # carried to this layout (see RescaledCost): said where it is read
            config["cost"] = cost.describe()
        wall = time.perf_counter() - started if started is not None else 0.0
        return SimResult(records, all_replicas, config=config, requests=reqs, wall_s=wall)

    def _record(self, res: SimResult, workload: dict[str, Any], run_log, predicts: int | None) -> int | None:
        from ..runs import open_log, recording_enabled, safe_finish, safe_start

        if run_log is None and not recording_enabled():
            return None
        log = open_log(run_log)
        cfg = res.config
        label = f"simulate {self.source}" + (f" {self.profile.name}" if self.profile is not None else "")
        extra = {k: cfg[k] for k in ("replicas", "router", "disaggregated", "slo", "num_kv_blocks")}
        extra.update(simulator=self.describe(), predicts=predicts)
        run_id = safe_start(
            log,
            "simulation",
            label=label,
            model=self.model_name,
            device=f"simulated {self.device}",
            settings=cfg["settings"],
            workload=workload,
            extra=extra,
        )
        safe_finish(log, run_id, "completed", metrics=res.summary())
        return run_id

    def replicas_for(
        self,
        slo: dict[str, float],
        workload=None,
        *,
        settings=None,
        router="least_outstanding",
        attainment: float = 0.99,
        max_replicas: int = 64,
    ) -> int | None:
        """The smallest replica count whose SLO attainment reaches `attainment` (None: not within
        `max_replicas`)."""
        lo, hi, best = 1, max_replicas, None
        while lo <= hi:  # attainment grows with replicas: bisect
            mid = (lo + hi) // 2
            res = self.run(workload, settings, replicas=mid, router=router, slo=slo, timeline_capacity=16, record=False)
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
        to read); a fit is carried to another layout by this CPU's roofline ratio."""
        q = settings.quantization
        if isinstance(self.cost, RooflineCost):
            if q == "none":
                return self.cost
            return RooflineCost(self.cost.profile, self._shape(quantization=q))
        fitted_at = (self.calibration or {}).get("quantization")
        if fitted_at is not None and q != fitted_at:
            return self._rescaled(self._shape(quantization=q), f"quantization {fitted_at!r} -> {q!r}")
        return self.cost

    def _shape(self, model=None, quantization: str = "none") -> ModelShape:
        """A model's shape (its config read once per simulator; None: the simulated model)."""
        key = (model or self.model_name, quantization)
        if key not in self._shapes:
            self._shapes[key] = ModelShape.of(model_config(key[0]), quantization=quantization)
        return self._shapes[key]

    def _cpu(self) -> Profile:
        """This host's roofline, measured once per simulator (a bandwidth and a matmul probe)."""
        if self._cpu_profile is None:
            self._cpu_profile = get_profile("cpu")
        return self._cpu_profile

    def _rescaled(self, target: ModelShape, what: str):
        """The fit carried to another layout by this machine's roofline ratio (see RescaledCost)."""
        if not str(self.device or "cpu").startswith("cpu"):
            raise ValueError(
                f"this step-cost fit was measured on {self.device}; simulating {what} needs a "
                "calibration at that layout (or a roofline profile): no roofline of that GPU here"
            )
        fitted_at = (self.calibration or {}).get("quantization") or "none"
        prof = self._cpu()
        measured = self._shape(quantization=fitted_at)
        return RescaledCost(self.cost, RooflineCost(prof, target), RooflineCost(prof, measured), what)

    def _draft_cost(self, settings: EngineSettings):
        """The draft proposer's forward cost per round (None: n-gram, whose lookups cost nothing
        measurable): the target's own int4 copy by default, else the draft model's shape, on the
        same machine as the target's cost."""
        if settings.speculative != "draft":
            return None
        draft = settings.draft_model
        shape = self._shape(draft, quantization="int4" if not draft else "none")
        if isinstance(self.cost, RooflineCost):
            return RooflineCost(self.cost.profile, shape)
        return self._rescaled(shape, f"draft {'the int4 copy' if not draft else draft}")

    def _kv_bytes_per_token(self) -> float:
        model = getattr(self.cost, "model", None)
        if model is not None:
            return model.kv_bytes_per_token
        try:
            return self._shape().kv_bytes_per_token
        except (OSError, ValueError) as e:
            raise ValueError(
                f"a disaggregated layout costs the KV transfer from the model's KV bytes per token, "
                f"and the config of {self.model_name!r} is not at hand: {e}"
            ) from None


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
