"""Cost and energy of serving, from measured throughput (pure functions, no engine needed).

    cost per million tokens = price per hour / 3600 / (tokens per second) * 1e6
    energy per token (J)    = power draw (W) / (tokens per second)

The machine's price and power draw are the user's to give (`price_per_hour=`, `watts=` on
`workbench.sweep`, or the environment variables `WORKBENCH_PRICE_PER_HOUR` and
`WORKBENCH_WATTS`). Without them these defaults apply, chosen by the engine's device:

| device | price per hour | power draw | what it stands for |
|---|---|---|---|
| cpu    | $0.20 | 100 W | a few server cores' share of an on-demand cloud VM, package power under load |
| cuda   | $3.00 | 700 W | one H100/H200-class GPU on demand, its board power limit |

Prefill and decode separately: the engine's timeline says how long each step took and how many
prompt tokens (prefill) and output tokens it produced. Pure-prefill steps count as prefill time,
pure-decode (and speculative verify) steps as decode time, and mixed steps (chunked prefill next
to decodes) are split in proportion to their prefill and decode tokens. Prefill cost is per
million *prompt* tokens computed (prefix-cache hits are free and not counted), decode cost per
million *output* tokens. Time the engine spends idle between steps is in neither phase; it is in
the end-to-end figure (`cost_per_mtok`, from wall-clock throughput), which is why that one is the
headline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

DEFAULTS = {
    "cpu": {"price_per_hour": 0.20, "watts": 100.0},
    "cuda": {"price_per_hour": 3.00, "watts": 700.0},
}


def machine_defaults(device: str | None = None) -> dict[str, float]:
    """Price per hour (USD) and power draw (W) for `device` ("cpu", "cuda", "cuda:1", ...),
    overridden by WORKBENCH_PRICE_PER_HOUR / WORKBENCH_WATTS when set."""
    kind = "cuda" if str(device or "cpu").startswith("cuda") else "cpu"
    out = dict(DEFAULTS[kind])
    for key, env in (("price_per_hour", "WORKBENCH_PRICE_PER_HOUR"), ("watts", "WORKBENCH_WATTS")):
        text = os.environ.get(env)
        if text:
            try:
                out[key] = float(text)
            except ValueError:
                raise ValueError(f"{env}={text!r} is not a number") from None
    return out


def resolve(price_per_hour: float | None, watts: float | None, device: str | None = None) -> dict[str, float]:
    """The user's figures where given, else the documented defaults for the device."""
    d = machine_defaults(device)
    out = {
        "price_per_hour": d["price_per_hour"] if price_per_hour is None else float(price_per_hour),
        "watts": d["watts"] if watts is None else float(watts),
    }
    for k, v in out.items():
        if not v >= 0:
            raise ValueError(f"{k} must be >= 0, got {v!r}")
    return out


def cost_per_million(tok_s: float | None, price_per_hour: float) -> float | None:
    """USD per million tokens at `tok_s` tokens per second (None when nothing was produced)."""
    if not tok_s or tok_s <= 0:
        return None
    return price_per_hour / 3600.0 / tok_s * 1e6


def joules_per_token(tok_s: float | None, watts: float) -> float | None:
    """Energy per token in joules at `tok_s` tokens per second."""
    if not tok_s or tok_s <= 0:
        return None
    return watts / tok_s


def phase_split(steps: Iterable[Any]) -> dict[str, float]:
    """Seconds and tokens of prefill and decode from timeline steps (`StepEvent`s or dicts with
    start, end, num_prefill_tokens, num_decode_tokens, output_tokens, phase)."""
    prefill_s = decode_s = 0.0
    prefill_tokens = output_tokens = 0
    for s in steps:
        get = s.get if isinstance(s, dict) else (lambda k, d=None, _s=s: getattr(_s, k, d))
        if get("phase") == "relayout":
            continue
        dur = max(float(get("end", 0.0)) - float(get("start", 0.0)), 0.0)
        p = int(get("num_prefill_tokens", 0) or 0)
        d = int(get("num_decode_tokens", 0) or 0)
        if p and d:
            share = p / (p + d)
        elif p:
            share = 1.0
        else:
            share = 0.0
        prefill_s += dur * share
        decode_s += dur * (1.0 - share)
        prefill_tokens += p
        output_tokens += int(get("output_tokens", 0) or 0)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens": prefill_tokens,
        "decode_output_tokens": output_tokens,
    }


def run_costs(
    output_tok_s: float | None, price_per_hour: float, watts: float, split: dict[str, float] | None = None
) -> dict[str, float | None]:
    """Cost and energy of one run: end to end from wall-clock output throughput, and (given a
    `phase_split`) for prefill and decode separately."""
    out: dict[str, float | None] = {
        "price_per_hour": price_per_hour,
        "watts": watts,
        "cost_per_mtok": cost_per_million(output_tok_s, price_per_hour),
        "joules_per_token": joules_per_token(output_tok_s, watts),
    }
    if split is not None:
        pre = split["prefill_tokens"] / split["prefill_s"] if split["prefill_s"] > 0 else None
        dec = split["decode_output_tokens"] / split["decode_s"] if split["decode_s"] > 0 else None
        out.update(
            prefill_tok_s=pre,
            decode_tok_s=dec,
            prefill_cost_per_mtok=cost_per_million(pre, price_per_hour),
            prefill_joules_per_token=joules_per_token(pre, watts),
            decode_cost_per_mtok=cost_per_million(dec, price_per_hour),
            decode_joules_per_token=joules_per_token(dec, watts),
        )
    return out


def live_costs(
    metrics: dict,
    steps: Iterable[Any] | None = None,
    *,
    price_per_hour: float | None = None,
    watts: float | None = None,
    device: str | None = None,
) -> dict[str, float | None]:
    """For the dashboard: cost and energy at the engine's current output rate (its `metrics()`),
    and per phase when recent timeline `steps` are given."""
    m = resolve(price_per_hour, watts, device)
    return run_costs(
        metrics.get("output_tok_s"), m["price_per_hour"], m["watts"], phase_split(steps) if steps is not None else None
    )


class LiveCosts:
    """Cost and energy over the engine's last `window_s` seconds of steps, for the dashboard:
    feed it the timeline events (`add`), ask with the latest `metrics()` (`costs`, `html`)."""

    def __init__(
        self,
        window_s: float = 10.0,
        *,
        price_per_hour: float | None = None,
        watts: float | None = None,
        device: str | None = None,
    ):
        from collections import deque

        self.window_s = window_s
        self.prices = resolve(price_per_hour, watts, device)
        self._steps: deque = deque()

    def add(self, timeline: Any) -> None:
        steps = timeline.get("steps") if isinstance(timeline, dict) else getattr(timeline, "steps", None)
        for s in steps or []:
            self._steps.append(s)
        if self._steps:
            last = self._steps[-1]
            latest = float(last.get("end", 0.0) if isinstance(last, dict) else getattr(last, "end", 0.0))
            while self._steps:
                first = self._steps[0]
                end = float(first.get("end", 0.0) if isinstance(first, dict) else getattr(first, "end", 0.0))
                if end >= latest - self.window_s:
                    break
                self._steps.popleft()

    def costs(self, metrics: dict) -> dict[str, float | None]:
        return run_costs(
            metrics.get("output_tok_s"),
            self.prices["price_per_hour"],
            self.prices["watts"],
            phase_split(self._steps) if self._steps else None,
        )

    def html(self, metrics: dict) -> str:
        """One line: end-to-end cost and energy per output token at the current rate, then each
        phase that ran in the window; an idle engine says so instead of printing dashes."""
        c = self.costs(metrics)
        machine = f"at ${self.prices['price_per_hour']:g}/h and {self.prices['watts']:g} W"
        if c["cost_per_mtok"] is None:
            return f"cost: nothing generated in the last {self.window_s:g} s ({machine})"
        parts = [
            f"prefill ${c['prefill_cost_per_mtok']:.3g}/M prompt tok" if c.get("prefill_cost_per_mtok") else None,
            f"decode ${c['decode_cost_per_mtok']:.3g}/M output tok" if c.get("decode_cost_per_mtok") else None,
        ]
        phases = "; ".join(p for p in parts if p)
        return (
            f"cost ${c['cost_per_mtok']:.3g} per million output tokens, {c['joules_per_token']:.3g} J each"
            + (f" ({phases})" if phases else "")
            + f" {machine}"
        )
