"""Step-cost models: how long one engine step takes, from what the step computes.

A step is described by its `StepShape`: prefill tokens, decode (and verify) tokens, sequences, and
the attention work (`attended`: the sum over the step's tokens of the context each one attends
to; `prefill_attended`: the prefill tokens' part of it). Two models turn a shape into seconds:

- `FittedCost`: a least-squares fit over a real engine's recorded steps (t = overhead +
  a * prefill + b * decode + c * prefill_attended + c' * decode_attended + d * sequences: a
  prefill chunk attends over a context it has just written, still in cache, a decode step over
  every running sequence's, read from memory, so a position can cost either differently;
  plus an offset and a
  per-decode-token term for steps above a size threshold, chosen by the fit: engines switch
  kernels there, e.g. our CPU path runs steps of up to 8 tokens as one fused call), with its
  error on the steps it was fitted on (`report`). A step's time is its period: from its start
  to the next step's start while the engine was busy, so the loop's own overhead counts;
- `RooflineCost`: a named accelerator's limits (`profiles.py`): per-step overhead plus the larger
  of the bytes it reads over bandwidth (weights once, the KV cache it attends over) and its FLOPs
  over the peak, each at an achievable fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .profiles import Profile

__all__ = ["FittedCost", "ModelShape", "RooflineCost", "StepShape", "shapes_from_timeline"]


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    attended: float  # sum over the step's tokens of the context each attends to
    prefill_attended: float = 0.0  # the part of `attended` from prefill tokens

    @classmethod
    def of(cls, parts: list[tuple[str, int, int]]) -> StepShape:
        """A step's shape from its sequences' (kind, tokens computed before, tokens computed now):
        one rule for the engine's recorded steps and the simulator's."""
        prefill = decode = 0
        work = prefill_work = 0.0
        for kind, start, n in parts:
            here = attended(start, n)
            work += here
            if kind == "prefill":
                prefill += n
                prefill_work += here
            else:
                decode += n
        return cls(prefill, decode, len(parts), work, prefill_work)

    def features(self, threshold: int = 1 << 30) -> list[float]:
        big = 1.0 if self.prefill_tokens + self.decode_tokens > threshold else 0.0
        return [
            1.0,
            self.prefill_tokens,
            self.decode_tokens,
            self.prefill_attended / 1e3,
            (self.attended - self.prefill_attended) / 1e3,
            self.num_seqs,
            big,
            big * self.decode_tokens,
        ]


FEATURES = (
    "overhead_s",
    "per_prefill_token_s",
    "per_decode_token_s",
    "per_1k_prefill_attended_s",
    "per_1k_decode_attended_s",
    "per_seq_s",
    "large_step_s",
    "per_decode_token_large_s",
)
THRESHOLDS = (4, 8, 16, 32, 64, 128)  # step sizes (tokens) tried as the kernel switch
BUSY_GAP_S = 0.01  # a next step this soon after a step's end: the engine was busy in between


def attended(start: int, n: int) -> float:
    """Context summed over `n` tokens computed after `start` (causal: token i sees start + i + 1)."""
    return n * start + n * (n + 1) / 2


@dataclass
class ModelShape:
    """What the roofline needs of a model: bytes of weights read per step, matmul FLOPs per token,
    KV bytes per token and attention FLOPs per attended position."""

    weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float
    attention_flops_per_position: float
    name: str = ""

    @classmethod
    def of(cls, config, dtype_bytes: int = 2, quantization: str = "none") -> ModelShape:
        import torch

        from ..bench.roofline import model_costs

        dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes, torch.bfloat16)
        costs = model_costs(config, dtype, quantization)
        kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
        attn = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim  # QK^T and PV
        return cls(costs["weight_bytes"], 2.0 * costs["matmul_params"], kv, attn, getattr(config, "name", ""))


class RooflineCost:
    def __init__(self, profile: Profile, model: ModelShape):
        self.profile, self.model = profile, model
        self.bandwidth = profile.bandwidth_gbs * 1e9 * profile.bandwidth_efficiency
        self.peak = profile.peak_tflops * 1e12 * profile.compute_efficiency

    def __call__(self, s: StepShape) -> float:
        m = self.model
        tokens = s.prefill_tokens + s.decode_tokens
        read = m.weight_bytes + (s.attended + tokens) * m.kv_bytes_per_token
        flops = tokens * m.flops_per_token + s.attended * m.attention_flops_per_position
        return self.profile.step_overhead_ms / 1e3 + max(read / self.bandwidth, flops / self.peak)

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline", "profile": self.profile.name, **self.profile.as_dict()}


class RescaledCost:
    """A measured fit carried to another model layout (a quantisation it was not measured at, or a
    draft model) by a roofline's ratio on the same machine: fit(step) x target(step) / measured(step).
    The fit holds the machine's real level; the roofline only says how the layout changes it, so
    these predictions are extrapolations and say so."""

    def __init__(self, fit, target: RooflineCost, measured: RooflineCost, what: str):
        self.fit, self.target, self.measured, self.what = fit, target, measured, what

    def __call__(self, s: StepShape) -> float:
        return self.fit(s) * self.target(s) / self.measured(s)

    def describe(self) -> dict[str, Any]:
        return {**self.fit.describe(), "extrapolated": self.what, "by_profile": self.target.profile.name}


@dataclass
class FittedCost:
    coefficients: list[float]
    threshold: int = 1 << 30
    report: dict[str, Any] = field(default_factory=dict)
    # the steps it was fitted on (shapes, seconds), so later calibrations can be pooled with them
    samples: tuple[list[StepShape], list[float]] = field(default=((), ()), repr=False, compare=False)

    def __call__(self, s: StepShape) -> float:
        return max(1e-6, float(np.dot(self.coefficients, s.features(self.threshold))))

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float]) -> FittedCost:
        """Least squares of the relative error on the features for each candidate threshold,
        coefficients kept >= 0 (a negative one is dropped and the rest refitted); the threshold
        with the least mean error wins. The report holds that error on these steps."""
        if len(shapes) < 8:
            raise ValueError(f"a step-cost fit needs at least 8 recorded steps, got {len(shapes)}")
        y = np.array(seconds, dtype=np.float64)
        # Each kind of step (prefills; decodes of 1, 2-3, 4-7, 8-15, 16+ sequences) weighs the same in
        # total, however many of it the calibration made: else the many wide steps of a burst
        # outvote the single stream's, and small batches come out optimistic (docs/benchmarks.md).
        kinds = [("prefill" if s.prefill_tokens else min(s.num_seqs.bit_length(), 5)) for s in shapes]
        counts = {k: kinds.count(k) for k in set(kinds)}
        w = np.array([counts[k] ** -0.5 for k in kinds])  # rows x w: squared errors weigh 1 / count
        best = None
        for threshold in (*THRESHOLDS, 1 << 30):
            x = np.array([s.features(threshold) for s in shapes], dtype=np.float64)
            # relative errors: a 10 ms single-stream step counts as much as a 200 ms prefill
            coef = _nonnegative_lstsq(x / y[:, None] * w[:, None], w)
            pred = x @ coef
            mape = float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-9)))
            if best is None or mape < best[0] - 1e-4:
                best = (mape, threshold, coef, pred)
        mape, threshold, coef, pred = best
        err = np.abs(pred - y) / np.maximum(y, 1e-9)
        ss_res = float(np.sum((y - pred) ** 2))
        ss_tot = float(np.sum((y - y.mean()) ** 2)) or 1e-30
        report = {
            "kind": "fitted",
            "steps": len(shapes),
            "mape": mape,
            "p90_error": float(np.quantile(err, 0.9)),
            "r2": 1.0 - ss_res / ss_tot,
            "threshold_tokens": threshold if threshold < 1 << 30 else None,
            "coefficients": dict(zip(FEATURES, map(float, coef))),
            "mean_step_ms": float(y.mean() * 1e3),
        }
        return cls([float(c) for c in coef], threshold, report, (list(shapes), list(seconds)))

    @classmethod
    def pooled(cls, fits: list[FittedCost]) -> FittedCost:
        """One fit over the steps of several fits (calibrations made at different moments)."""
        shapes, seconds = [], []
        for f in fits:
            if not f.samples[0]:
                raise ValueError(
                    "a fit read back from its coefficients has no steps to pool; pool fits made by "
                    "FittedCost.fit or Simulator.calibrate in this process"
                )
            shapes += f.samples[0]
            seconds += f.samples[1]
        return cls.fit(shapes, seconds)

    def describe(self) -> dict[str, Any]:
        return dict(self.report)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        negative = [k for k, c in zip(keep, coef) if c < 0 and k != 0]
        if not negative:
            break
        keep.remove(negative[0])
    full = np.zeros(x.shape[1])
    full[keep] = np.maximum(coef, 0.0)
    return full


def shapes_from_timeline(steps, requests=()) -> tuple[list[StepShape], list[float]]:
    """Each recorded step's shape and period (its duration plus the gap to the next step while
    the engine was busy; the typical such gap after a step followed by idle time). A request's
    context is rebuilt from the batch entries in order (a prefix-cache hit starts it further on;
    a preemption starts it again). A request's "finished" is not read: the engine records it
    inside the step that produced the last token, ahead of that step, whose entry keeps its context."""
    computed: dict[str, int] = {}
    events = sorted(((r.seq, r) for r in requests), key=lambda e: e[0])
    ei = 0
    shapes, seconds = [], []
    ordered = sorted(steps, key=lambda s: s.seq)
    gaps = [b.start - a.end for a, b in zip(ordered, ordered[1:]) if 0 <= b.start - a.end < BUSY_GAP_S]
    typical_gap = float(np.median(gaps)) if gaps else 0.0
    for k, st in enumerate(ordered):
        while ei < len(events) and events[ei][0] < st.seq:
            ev = events[ei][1]
            if ev.kind in ("scheduled", "resumed"):
                hit = ev.detail.split("=", 1)[1] if ev.detail and ev.detail.startswith("prefix_hit=") else "0"
                computed[ev.request_id] = int(hit) if hit.isdigit() else 0
            ei += 1
        parts = []
        for entry in st.batch:
            start = computed.get(entry.request_id, 0)
            parts.append((entry.kind, start, entry.num_tokens))
            computed[entry.request_id] = start + entry.num_tokens
        nxt = ordered[k + 1] if k + 1 < len(ordered) else None
        gap = nxt.start - st.end if nxt is not None else None
        dur = st.end - st.start + (gap if gap is not None and 0 <= gap < BUSY_GAP_S else typical_gap)
        if st.phase == "relayout" or not math.isfinite(dur) or dur <= 0:
            continue
        shapes.append(StepShape.of(parts))
        seconds.append(dur)
    return shapes, seconds
