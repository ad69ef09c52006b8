"""What a router costs and what quality it keeps, per threshold, measured.

`evaluate(router, prompts)` runs the prompt set through every member once (greedy unless told
otherwise, with each token's log-probability), prices each answer, scores it, and then plays the
router's policy over those answers at each threshold: a routed greedy answer is its member's solo
answer token for token (the tests hold the router to that), so the answers need not be generated
again per threshold. A cascade's escalated requests pay for every member they ran on, and wait for
them (their TTFT is the cheaper members' whole answers plus the last one's first token).

Cost per request: a member's price per 1M prompt and output tokens when `prices` gives one, else
the machine's price (`tuning.costs.machine_defaults`) for the member's share of the seconds its run
took (split by tokens). Quality, without labels: agreement with the dearest member's greedy answer
(token-level F1; exact match and the dearest member's mean log-likelihood of the answer are kept
too); or `scorer(prompt, output) -> float`. RouteLLM's measures: performance gap recovered (PGR)
per threshold, its average over the sweep (APGR) and the dearer share needed for 50% / 80% of the
gap (CPT).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .policies import Draws, calibrate_threshold, check_threshold, level, output_confidence

SHARES = tuple(i / 10 for i in range(11))  # the default sweep: these shares past the cheapest member


class Evaluation(list):
    """One record per threshold (a list of dicts), with the members alone (`members`, `answers`), RouteLLM's
    `apgr` and `cpt` ({0.5: share, 0.8: share}), and `plot()`: the cost/quality Pareto front."""

    members: dict[str, dict]
    answers: dict[str, list]  # each member's answer to each prompt (RequestOutputs, in prompt order)
    scores: list[list[float]]  # each prompt's score at each boundary (what the policy compares)
    items: list[tuple]  # the prompts as (text, token ids, params)
    max_tokens: int
    apgr: float | None
    cpt: dict[float, float | None]
    policy: str

    def plot(self, width: int = 520, height: int = 360):
        return pareto_plot(self, width=width, height=height)

    def label(self, index: int) -> str:
        """A threshold as the picker names it: the share it sends past the cheapest, cost, quality."""
        r = self[index]
        return (
            f"threshold {r['threshold']:.4g}: {r['large_share']:.0%} past the cheapest, "
            f"${r['cost_per_request'] * 1000:.4f} / 1k requests, quality {r['quality']:.3f}"
        )

    def apply(self, index: int, router) -> dict:
        """Route live by this record's policy and threshold (router.configure); the settings back."""
        return router.configure(router=self.policy, router_threshold=self[index]["threshold"])

    def levels(self, threshold: float) -> list[int]:
        """The member each prompt goes to at `threshold` (an index, cheapest 0), from the scores
        this evaluation measured (a cascade's: each member's confidence in its own answer)."""
        if self.policy == "fixed":
            return [int(threshold)] * len(self.scores)
        n = len(self.members)
        return [level(self.policy, s, [check_threshold(threshold)] * (n - 1)) for s in self.scores]

    def requests(self):
        """The prompt set as the bench's requests, all at once (`workbench.bench.driver.run_workload`
        serves them on the router; `predict` simulates them)."""
        from ..bench.workload import BenchRequest

        cheapest = self.answers[next(iter(self.answers))]
        return [
            BenchRequest(i, list(o.prompt_token_ids), self.max_tokens, 0.0, prompt)
            for i, (o, (prompt, _, _)) in enumerate(zip(cheapest, self.items))
        ]

    def predict(self, sims: dict, threshold: float, *, shared_host: bool = True):
        """The simulator's prediction of this prompt set routed at `threshold`, all at once
        (a `workbench.sim.RoutedResult`): `sims` maps each member to its Simulator (e.g.
        `Simulator.calibrate(member)`); the decisions and each member's answer lengths are the ones
        measured here (greedy answers are deterministic). `shared_host`: the members' engines share
        this machine's cores (steps take turns); False: each member on a machine of its own."""
        from ..sim import route

        names = list(self.members)
        missing = [n for n in names if n not in sims]
        if missing:
            raise ValueError(f"predict needs a Simulator for every member; missing {missing}")
        at = self.levels(threshold)
        lengths = {n: [len(o.token_ids) for o in self.answers[n]] for n in names}
        if self.policy == "cascade":
            routes = [(n, sims[n], None) for n in names]
            escalate = lambda r, name: at[r.index] > names.index(name)  # noqa: E731
        else:
            routes = [(n, sims[n], (lambda r, k=k: at[r.index] == k)) for k, n in enumerate(names)]
            escalate = None
        return route(
            self.requests(),
            routes,
            escalate=escalate,
            output_len=lambda r, name: lengths[name][r.index],
            shared_host=shared_host,
        )

    def widget(self, router=None):
        """The Pareto plot with a threshold picker and "Apply to router" (tapping a dot picks it),
        as the sweeps' plot has for settings; without ipywidgets, the plot alone."""
        fig = self.plot()
        try:
            import ipywidgets as W
            from jupyter_bokeh.widgets import BokehModel

            from ..bokehjs import ensure_bokehjs
            from ..tuning.plots import point_picker
        except ImportError:
            return fig
        ensure_bokehjs()  # BokehJS from the installed bokeh, never a CDN
        front = [i for i, r in enumerate(self) if r.get("pareto")]
        row, status = point_picker(
            [(self.label(i), i) for i in range(len(self))],
            (front or [0])[0] if len(self) else None,
            lambda i: self.apply(i, router),
            source=getattr(fig, "_workbench_source", None),
            description="threshold",
            width="560px",
            button="Apply to router",
            target=router,
            target_name="router",
            name=self.label,
            done=lambda i: f"routing live by <b>{self.label(i)}</b>",
        )
        return W.VBox([BokehModel(fig), row, status])


def _f1(a: Sequence[int], b: Sequence[int]) -> float:
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def evaluate(
    router,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    scorer: Callable[[Any, Any], float] | None = None,
    thresholds: Sequence[float] | None = None,
    *,
    params=None,
    prices: dict[str, float | tuple[float, float]] | None = None,
    concurrency: int | None = None,
) -> Evaluation:
    """Per threshold, cheapest first (the share past the cheapest member ascending): "threshold",
    "cost_per_request" (USD), "quality", "share" (member -> fraction), "ttft_p50_ms",
    "large_share", "pgr", "exact_match", "f1", "loglik". `thresholds`
    None: those sending 0%, 10%, ..., 100% past the cheapest member (the fixed policy: each member
    alone). `params`: SamplingParams (default greedy, 32 tokens). `concurrency`: requests a member
    runs at once (None: all of them; 1: one at a time, a lone stream's cost)."""
    import msgspec

    from ..sampling_params import SamplingParams

    params = SamplingParams.coerce(params or SamplingParams(max_tokens=32, temperature=0.0))
    params = msgspec.structs.replace(params, logprobs=max(params.logprobs or 0, 0))
    items = router.items(prompts, params)
    names, policy = router.names, router.policy
    runs, seconds = _run_members(router, items, params, concurrency)  # every member on every prompt, once
    cost = _costs(router, runs, seconds, prices)
    measures = _measures(router, items, runs, scorer)
    scores = _scores(router, items, runs)
    ts, levels_per = _levels(policy, names, scores, thresholds)
    records = Evaluation(_record(t, levels, names, policy, runs, cost, measures) for t, levels in zip(ts, levels_per))
    records.sort(key=lambda r: (r["large_share"], r["cost_per_request"]))  # cheapest first, whatever the policy
    from ..tuning.pareto import pareto_front

    for i in pareto_front(records, [("cost_per_request", "min"), ("quality", "max")]):
        records[i]["pareto"] = True
    solo = {}
    for name in names:
        outs = runs[name]
        solo[name] = {
            "cost_per_request": sum(cost(name, o) for o in outs) / len(outs),
            "quality": sum(measures["quality"][name]) / len(outs),
            "ttft_p50_ms": statistics.median(o.metrics.ttft * 1e3 for o in outs if o.metrics.ttft is not None),
            "seconds": seconds[name],
        }
    lo, hi = solo[names[0]]["quality"], solo[names[-1]]["quality"]
    for r in records:
        r["pgr"] = (r["quality"] - lo) / (hi - lo) if hi != lo else None
    records.members, records.policy, records.answers = solo, policy, runs
    records.scores, records.items, records.max_tokens = scores, items, params.max_tokens
    gaps = [r["pgr"] for r in records if r["pgr"] is not None]
    records.apgr = sum(gaps) / len(gaps) if gaps else None
    records.cpt = {
        goal: min((r["large_share"] for r in records if r["pgr"] is not None and r["pgr"] >= goal), default=None)
        for goal in (0.5, 0.8)
    }
    return records


def _run_members(router, items, params, concurrency: int | None) -> tuple[dict[str, list], dict[str, float]]:
    """Each member's answers to every item, in order, and the seconds each member took."""
    runs: dict[str, list] = {}
    seconds: dict[str, float] = {}
    for name in router.names:
        engine = router.members[name]
        t0 = time.monotonic()
        runs[name] = []
        step = concurrency or len(items)
        for k in range(0, len(items), step):
            part = items[k : k + step]
            if part[0][1] is not None:
                runs[name] += engine.generate(prompt_token_ids=[ids for _, ids, _ in part], params=params)
            else:
                runs[name] += engine.generate([p for p, _, _ in part], params)
        seconds[name] = time.monotonic() - t0
    return runs, seconds


def _costs(router, runs: dict[str, list], seconds: dict[str, float], prices) -> Callable[[str, Any], float]:
    """An answer's cost in USD: its tokens at the member's given prices, else its share of the
    member's machine time (tokens over all the member's tokens) at the machine's price per hour."""
    from ..tuning.costs import machine_defaults

    price = machine_defaults(router.members[router.names[0]].status().get("device"))["price_per_hour"]

    def cost(name: str, out) -> float:
        n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
        given = (prices or {}).get(name)
        if given is not None:
            p_in, p_out = given if isinstance(given, (tuple, list)) else (given, given)
            return (n_in * p_in + n_out * p_out) / 1e6
        tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in runs[name]) or 1
        return price / 3600 * seconds[name] * (n_in + n_out) / tokens

    return cost


def _measures(router, items, runs: dict[str, list], scorer) -> dict[str, dict[str, list]]:
    """Every answer's quality (the scorer's, else its token F1 against the dearest member's
    answer), F1, exact match and log-likelihood under the dearest member: measure -> member -> list."""
    names = router.names
    ref = runs[names[-1]]
    dearest = router.members[names[-1]]
    out: dict[str, dict[str, list]] = {"quality": {}, "f1": {}, "exact": {}, "loglik": {}}
    for name in names:
        out["f1"][name] = [_f1(o.token_ids, r.token_ids) for o, r in zip(runs[name], ref)]
        out["exact"][name] = [float(list(o.token_ids) == list(r.token_ids)) for o, r in zip(runs[name], ref)]
        out["loglik"][name] = [_loglik(dearest, o) for o in runs[name]]
        if scorer is None:
            out["quality"][name] = out["f1"][name]
        else:
            asked = [item[0] if item[0] is not None else item[1] for item in items]
            out["quality"][name] = [float(scorer(prompt, o)) for prompt, o in zip(asked, runs[name])]
    return out


def _scores(router, items, runs: dict[str, list]) -> list[list[float]]:
    """Each request's score at each boundary (a cascade: each member's own confidence)."""
    names, policy = router.names, router.policy
    if policy in ("length", "classifier"):
        return [router.scores(item, policy) for item in items]
    if policy == "random":
        draws = Draws(0)
        return [[draws()] * (len(names) - 1) for _ in items]
    conf = {n: [output_confidence(o, router.how) for o in runs[n]] for n in names}
    return [[conf[n][i] for n in names[:-1]] for i in range(len(items))]


def _levels(policy: str, names: list[str], scores, thresholds) -> tuple[list[float], list[list[int]]]:
    """The thresholds evaluated, and at each the member (its index) every request goes to."""
    if policy == "fixed":
        return [float(i) for i in range(len(names))], [[names.index(n)] * len(scores) for n in names]
    if thresholds is None:
        first = [s[0] for s in scores]
        ts = sorted({calibrate_threshold(policy, first, share) for share in SHARES})
    else:
        ts = [check_threshold(t) for t in thresholds]
    return ts, [[level(policy, s, [t] * (len(names) - 1)) for s in scores] for t in ts]


def _record(t: float, levels: list[int], names, policy: str, runs, cost, measures) -> dict:
    """One threshold's row: its mean cost, quality and measures, its members' shares, its TTFT
    (a cascade's request waits for every member it ran before the one that answered)."""
    costs, ttfts, share = [], [], Counter()
    picked: dict[str, list] = {m: [] for m in measures}
    for i, at in enumerate(levels):
        name = names[at]
        ran = names[: at + 1] if policy == "cascade" else [name]
        costs.append(sum(cost(n, runs[n][i]) for n in ran))
        waited = sum(_latency(runs[n][i]) for n in ran[:-1])
        ttft = runs[name][i].metrics.ttft
        ttfts.append(None if ttft is None else (waited + ttft) * 1e3)
        for m in measures:
            picked[m].append(measures[m][name][i])
        share[name] += 1
    n = len(levels)
    return {
        "threshold": t,
        "cost_per_request": sum(costs) / n,
        "quality": sum(picked["quality"]) / n,
        "share": {m: share[m] / n for m in names},
        "large_share": 1 - share[names[0]] / n,
        "ttft_p50_ms": statistics.median([x for x in ttfts if x is not None]) if any(ttfts) else None,
        "f1": sum(picked["f1"]) / n,
        "exact_match": sum(picked["exact"]) / n,
        "loglik": _mean(picked["loglik"]),
    }


def _latency(out) -> float:
    m = out.metrics
    return (m.finished - m.arrival) if m.finished is not None and m.arrival is not None else 0.0


def _loglik(engine, out) -> float | None:
    """The dearest member's mean log-probability of this answer after its prompt."""
    if not out.token_ids:
        return None
    lps = engine.score(list(out.prompt_token_ids) + list(out.token_ids))[-len(out.token_ids) :]
    lps = [x for x in lps if x is not None]
    return sum(lps) / len(lps) if lps else None


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def pareto_plot(records: Evaluation, *, width: int = 520, height: int = 360):
    """Cost per request against quality, one dot per threshold, the members alone as squares, the
    Pareto front (cheaper and better) as the sweeps' dashed red line; tap a dot to pick it."""
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.plotting import figure

    from ..tuning.plots import FRONT

    front = {i for i, r in enumerate(records) if r.get("pareto")}
    data = {
        "cost": [r["cost_per_request"] * 1000 for r in records],
        "quality": [r["quality"] for r in records],
        "threshold": [r["threshold"] for r in records],
        "large_share": [r["large_share"] for r in records],
        "pgr": [r["pgr"] if r["pgr"] is not None else float("nan") for r in records],
        "color": [FRONT if i in front else "#4C72B0" for i in range(len(records))],
    }
    p = figure(
        width=width,
        height=height,
        title=f"router ({records.policy}): cost vs quality per threshold",
        x_axis_label="USD per 1000 requests",
        y_axis_label="quality",
        tools="pan,wheel_zoom,box_zoom,tap,reset,save",
        toolbar_location="above",
    )
    pts = sorted((data["cost"][i], data["quality"][i]) for i in front)
    if pts:
        p.line([x for x, _ in pts], [y for _, y in pts], line_color=FRONT, line_dash="dashed", line_width=2)
    source = ColumnDataSource(data)
    dots = p.scatter("cost", "quality", source=source, size=10, fill_color="color", selection_fill_color="#2ca02c")
    p._workbench_source = source  # for widget(): tapping a dot picks its threshold
    for name, solo in records.members.items():
        p.scatter([solo["cost_per_request"] * 1000], [solo["quality"]], marker="square", size=12, fill_color="#999999")
        p.text([solo["cost_per_request"] * 1000], [solo["quality"]], text=[f" {name} alone"], text_font_size="11px")
    p.add_tools(
        HoverTool(
            renderers=[dots],
            tooltips=[
                ("threshold", "@threshold{0.000}"),
                ("share past the cheapest", "@large_share{0%}"),
                ("USD / 1000 requests", "@cost{0.0000}"),
                ("quality", "@quality{0.000}"),
                ("gap recovered", "@pgr{0%}"),
            ],
        )
    )
    p.y_range.range_padding = 0.15  # room for whiskers and labels at the ends
    return p
