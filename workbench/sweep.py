"""Sweeps: one fixed, seeded workload measured at every point of a settings grid.

    eng = workbench.start_engine()                       # or workbench.LLM()
    res = workbench.sweep(eng, grid={"batching": ["continuous", "static"], "max_num_seqs": [4, 16]},
                          workload={"num_requests": 16}, repeats=3)
    res.table()          # a DataFrame when pandas is installed, else row dicts
    res.show()           # Bokeh: throughput vs p99 TTFT / p99 ITL, Pareto front, hover, "apply" button
    res.apply(2)         # configure the engine with point 2 (index, label or record)

`engine` is anything with `configure`, `settings`, `generate`, `metrics` and `status`: an
`EngineClient` (the engine process), an in-process `LLM`, or a look-alike. For each grid point
(re-layout settings vary slowest, so an expensive re-layout happens once per value):

1. `configure(**point)` — it returns once the change (a re-layout included) is in place;
2. warm-up: `warmup` short requests from the workload, then the prefix cache is emptied;
3. `repeats` measured runs of the whole workload (greedy, `ignore_eos`, prefix cache emptied before
   each), per run: output tok/s, TTFT/ITL percentiles (`workbench.bench.stats.summarize`), peak
   and mean KV use and prefill/decode time (from the engine timeline), prefix hit rate and
   speculative acceptance (from the engine's counters), cost and energy (`workbench.costs`);
4. where the point is quantised (weights or KV cache): perplexity on the workload's text and its
   difference from the unquantised model (`delta_ppl`).

A record per point holds the medians over repeats, the spread (`<metric>_min/_max/_std`) and the
per-run numbers; `pareto`/`pareto_ttft_p99`/`pareto_itl_p99` mark the fronts, and `overlaps` /
`noisy` name the points whose throughput spread overlaps this one (so a "winner" inside the noise
is visible as such).

Interrupting (Ctrl-C, the notebook's stop button) aborts the in-flight requests, puts the engine
back on the settings it had before the sweep and marks the sweep `interrupted` in the run log.
Running the same sweep again resumes: points already measured (same model weights, workload,
grid, repeats, base settings) are taken from the run log, not rerun; `resume=False` measures
everything again.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import itertools
import json
import math
import queue
import statistics
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .bench.stats import NoProgress, RequestRecord, summarize
from .bench.workload import BenchRequest, Workload, make_workload
from .costs import phase_split, resolve, run_costs
from .pareto import annotate, spread
from .runs import RunLog, recording_enabled, safe_finish, safe_start
from .settings import RELAYOUT, RELOAD, RESTART, setting_kind, setting_names, validate

DEFAULT_WORKLOAD = {"num_requests": 16, "prompt_len": (16, 64), "output_len": (8, 32), "seed": 0, "arrival": "all"}
DEFAULT_MAX_TOKENS = 32  # output length for prompt-list workloads
SPREAD_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "cost_per_mtok")
QUANT_DEFAULTS = {"quantization": "none", "kv_cache_dtype": "auto"}
TABLE_COLUMNS = ("output_tok_s", "output_tok_s_min", "output_tok_s_max", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                 "itl_p99_ms", "kv_usage_peak", "prefix_hit_rate", "spec_acceptance_rate", "delta_ppl",
                 "cost_per_mtok", "joules_per_token", "pareto", "noisy", "overlaps", "repeats", "resumed")
COST_COLUMNS = ("output_tok_s", "cost_per_mtok", "joules_per_token", "prefill_tok_s", "prefill_cost_per_mtok",
                "prefill_joules_per_token", "decode_tok_s", "decode_cost_per_mtok", "decode_joules_per_token")


# ----------------------------------------------------------------------------- the grid
def grid_points(grid: dict[str, Sequence[Any] | Any]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, validated (names, values, no start-time settings).

    Settings that re-lay out or reload the model vary slowest (outermost), the rest in the order
    given, so a sweep pays for each re-layout once per value."""
    if not isinstance(grid, dict) or not grid:
        raise ValueError("grid must be a non-empty dict of setting name -> list of values")
    names = setting_names()
    values: dict[str, list[Any]] = {}
    for name, vals in grid.items():
        if name not in names:
            raise ValueError(f"unknown setting {name!r} in the grid; known settings: {', '.join(names)}")
        if setting_kind(name) == RESTART:
            raise ValueError(f"setting {name!r} is fixed when the engine starts and cannot be swept live; "
                             "start one engine per value instead")
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Iterable):
            vals = [vals]
        vals = list(vals)
        if not vals:
            raise ValueError(f"grid entry {name!r} has no values")
        checked = [validate({name: v})[name] for v in vals]
        if len({json.dumps(v) for v in checked}) != len(checked):
            raise ValueError(f"grid entry {name!r} repeats a value: {vals}")
        values[name] = checked
    order = sorted(values, key=lambda n: 0 if setting_kind(n) in (RELAYOUT, RELOAD) else 1)
    return [dict(zip(order, combo)) for combo in itertools.product(*(values[n] for n in order))]


def point_label(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- the workload
def _local_tokenizer(engine, status: dict):
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        return tok
    try:
        from .models.loader import DEFAULT_MODEL, default_gguf_path, ensure_converted

        if status.get("model") == DEFAULT_MODEL:
            from .tokenizer import Tokenizer

            return Tokenizer.from_dir(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    except Exception:  # no local copy of the model: fall back to token ids
        pass
    return None


def make_sweep_workload(engine, workload=None, *, max_tokens: int = DEFAULT_MAX_TOKENS, status: dict | None = None
                        ) -> Workload:
    """The workload a sweep runs, as token ids (the bench `Workload`):

    - None, an int (number of requests) or a dict of `make_workload` arguments: a bench workload
      (English text when the model's tokenizer is at hand, else seeded token ids), defaults
      `DEFAULT_WORKLOAD`;
    - a bench `Workload`: as is;
    - a list of prompts (str) and/or token-id lists: each one request of `max_tokens` output tokens,
      all arriving at once (text is tokenized by the engine's tokenizer).
    """
    status = status if status is not None else engine.status()
    if isinstance(workload, Workload):
        return workload
    if workload is None or isinstance(workload, (int, dict)):
        kw = dict(DEFAULT_WORKLOAD)
        if isinstance(workload, int):
            kw["num_requests"] = workload
        elif isinstance(workload, dict):
            unknown = set(workload) - {"num_requests", "seed", "prompt_len", "output_len", "arrival", "rate"}
            if unknown:
                raise ValueError(f"unknown workload option(s) {sorted(unknown)}; allowed: num_requests, seed, "
                                 "prompt_len, output_len, arrival, rate")
            kw.update(workload)
        kw["prompt_len"], kw["output_len"] = tuple(kw["prompt_len"]), tuple(kw["output_len"])
        tok = _local_tokenizer(engine, status)
        return make_workload(tokenizer=tok, vocab_size=status.get("vocab_size"), **kw)
    if isinstance(workload, (list, tuple)):
        if not workload:
            raise ValueError("the workload's prompt list is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids: list[list[int] | None] = []
        texts = [p for p in workload if isinstance(p, str)]
        for p in workload:
            if isinstance(p, str):
                ids.append(None)
            elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids.append(list(p))
            else:
                raise TypeError(f"a workload prompt must be a str or a non-empty list of token ids, got {p!r}")
        if texts:
            encoded = _tokenize(engine, status, texts)
            it = iter(encoded)
            ids = [next(it) if x is None else x for x in ids]
        reqs = [BenchRequest(i, x, max_tokens, 0.0) for i, x in enumerate(ids)]
        w = Workload(reqs, seed=0, source="prompts", prompt_len_range=(min(map(len, ids)), max(map(len, ids))),
                     output_len_range=(max_tokens, max_tokens))
        w.extra["prompts"] = [p if isinstance(p, str) else None for p in workload]
        return w
    raise TypeError("workload must be None, an int, a dict of make_workload options, a bench Workload or a "
                    f"list of prompts; got {type(workload).__name__}")


def _tokenize(engine, status: dict, texts: list[str]) -> list[list[int]]:
    tok = _local_tokenizer(engine, status)
    if tok is not None:
        return [tok.encode(t, add_special_tokens=True) for t in texts]
    # No tokenizer here: let the engine tokenize (one-token requests; their prompts come back as ids).
    from .sampling_params import SamplingParams

    outs = engine.generate(texts, SamplingParams(max_tokens=1, temperature=0.0))
    return [list(o.prompt_token_ids) for o in outs]


def workload_definition(w: Workload) -> dict[str, Any]:
    d = w.describe()
    d["fingerprint"] = _hash([[r.prompt_token_ids, r.max_tokens, r.arrival_s] for r in w.requests])
    if w.extra.get("prompts"):
        d["prompts"] = w.extra["prompts"]
    return d


# ----------------------------------------------------------------------------- engine access
class _Engine:
    """What the sweep needs from an engine, over `LLM`, `EngineClient` and look-alikes."""

    def __init__(self, engine, cancel: threading.Event | None = None):
        self.obj = engine
        self.cancel = cancel
        # Ids of requests sent to an engine client and not yet known to be done; filled by the
        # client before it sends, so an interrupt at any point leaves nothing unaccounted for.
        self.in_flight: list[str] = []
        core = getattr(engine, "engine", None)
        self.core = core if core is not None and hasattr(core, "step") and hasattr(core, "add_request") else None
        for name in ("configure", "settings", "generate", "metrics", "status"):
            if not callable(getattr(engine, name, None)):
                raise TypeError(f"sweep needs an engine with configure/settings/generate/metrics/status; "
                                f"{type(engine).__name__} has no {name}()")

    def abort_in_flight(self) -> None:
        """Abort whatever a run left behind (an interrupt can skip a run's own clean-up)."""
        if self.in_flight:
            left, self.in_flight = self.in_flight, []
            self.obj._cleanup(left, set())

    def check(self) -> None:
        """Raise KeyboardInterrupt when `asweep`'s task was cancelled (the sweep runs on a worker
        thread there, which a kernel interrupt does not reach)."""
        if self.cancel is not None and self.cancel.is_set():
            raise KeyboardInterrupt("sweep cancelled")

    def configure(self, **changes) -> dict:
        return self.obj.configure(**changes)

    def settings(self) -> dict:
        return dict(self.obj.settings())

    def status(self) -> dict:
        return dict(self.obj.status())

    def metrics(self) -> dict:
        return dict(self.obj.metrics())

    def _method(self, name: str):
        f = getattr(self.obj, name, None)
        if callable(f):
            return f
        f = getattr(self.core, name, None) if self.core is not None else None
        return f if callable(f) else None

    def reset_prefix_cache(self) -> None:
        f = self._method("reset_prefix_cache")
        if f is not None:
            f()

    def score(self, ids: list[int]) -> list[float] | None:
        f = self._method("score")
        return None if f is None else f(ids)

    def timeline_cursor(self) -> int | None:
        f = getattr(self.obj, "timeline", None)
        if not callable(f):
            return None
        try:
            return f(since=1 << 62).cursor
        except Exception:
            return None

    def steps_since(self, cursor: int | None) -> list:
        if cursor is None:
            return []
        try:
            return list(self.obj.timeline(since=cursor).steps)
        except Exception:
            return []

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Let other clients' requests drain so they do not share the measured run."""
        if self.core is not None:
            return
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if not (m.get("num_running") or m.get("num_waiting")):
                return
            if time.monotonic() > deadline:
                warnings.warn("the engine is still busy with other requests; measuring anyway", RuntimeWarning,
                              stacklevel=3)
                return
            time.sleep(0.05)

    # -- serving a workload ----------------------------------------------------------------------
    def run(self, requests: list[BenchRequest], progress=None) -> tuple[list[RequestRecord], float]:
        """Serve the requests (each released at its arrival offset; greedy, ignore_eos); returns
        (records in request order, start time)."""
        w = Workload(list(requests), 0)
        self.check()
        if self.core is not None:
            return self._run_in_process(w, progress)
        if callable(getattr(self.obj, "_submit", None)) and callable(getattr(self.obj, "_cleanup", None)):
            return self._run_client(w, progress)
        return self._run_plain(w, progress)

    def _run_in_process(self, w: Workload, progress):
        from .bench.runner import run_engine

        before = set(self.core.requests)
        try:
            return run_engine(self.core, w, progress=_Checked(progress, self.check))
        except BaseException:
            for rid in [r for r in list(self.core.requests) if r not in before]:
                self.core.abort_request(rid)
            raise

    def _run_client(self, w: Workload, progress):
        from .sampling_params import SamplingParams, normalize_batch

        eng = self.obj
        pending = sorted(w.requests, key=lambda r: (r.arrival_s, r.index))
        q: queue.SimpleQueue = queue.SimpleQueue()
        owner: dict[str, tuple[BenchRequest, float]] = {}
        submitted = self.in_flight  # filled by _submit before it sends
        done: dict[int, RequestRecord] = {}
        finished: set[str] = set()
        start = time.monotonic()
        i = 0
        try:
            while i < len(pending) or len(done) < len(owner):
                self.check()
                now = time.monotonic()
                group = []
                while i < len(pending) and start + pending[i].arrival_s <= now:
                    group.append(pending[i])
                    i += 1
                if group:
                    batch = normalize_batch(
                        None, [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in group],
                        [r.prompt_token_ids for r in group])
                    first = len(submitted)
                    eng._submit(batch, False, False, q.put, into=submitted)
                    for rid, r in zip(submitted[first:], group):
                        owner[rid] = (r, start + r.arrival_s)
                wait = 0.1 if i >= len(pending) else max(0.0, min(0.1, start + pending[i].arrival_s - time.monotonic()))
                try:
                    item = q.get(timeout=wait) if wait > 0 else q.get_nowait()
                except queue.Empty:
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is None or item.request_id not in owner:
                    continue
                finished.add(item.request_id)
                r, arrival = owner[item.request_id]
                out = item.output
                m = out.metrics
                done[r.index] = RequestRecord(r.index, arrival, len(out.prompt_token_ids), list(out.token_ids),
                                              list(m.token_times), m.finished)
                if progress is not None:
                    progress.update(1)
        finally:
            eng._cleanup(submitted, finished)  # aborts what is still running (interrupt, error)
            submitted.clear()
        return [done[k] for k in sorted(done)], start

    def _run_plain(self, w: Workload, progress):
        from .sampling_params import SamplingParams

        reqs = sorted(w.requests, key=lambda r: r.index)
        start = time.monotonic()
        outs = self.obj.generate(
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            params=[SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs])
        recs = [RequestRecord(r.index, start, len(o.prompt_token_ids), list(o.token_ids), list(o.metrics.token_times),
                              o.metrics.finished) for r, o in zip(reqs, outs)]
        if progress is not None:
            progress.update(len(reqs))
        return recs, start


# ----------------------------------------------------------------------------- measuring
def measure_run(eng: _Engine, workload: Workload, *, price_per_hour: float, watts: float, progress=None,
                reset_prefix_cache: bool = True) -> dict[str, Any]:
    """One measured run of the workload at the engine's current settings."""
    if reset_prefix_cache:
        eng.reset_prefix_cache()
    eng.wait_idle()
    m0 = eng.metrics()
    cursor = eng.timeline_cursor()
    records, start = eng.run(workload.requests, progress)
    m1 = eng.metrics()
    steps = eng.steps_since(cursor)
    out = summarize(records, start)

    def delta(k: str) -> float:
        return (m1.get(f"total_{k}") or 0) - (m0.get(f"total_{k}") or 0)

    prompt = delta("prompt_tokens")
    out["prefix_hit_rate"] = delta("prefix_hit_tokens") / prompt if prompt > 0 else 0.0
    proposed = delta("spec_proposed")
    out["spec_acceptance_rate"] = delta("spec_accepted") / proposed if proposed > 0 else None
    out["spec_mean_accepted"] = delta("spec_accepted") / delta("spec_verifies") if delta("spec_verifies") > 0 else None
    out["preemptions"] = delta("preemptions")
    usage = [(s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0, max(s.end - s.start, 0.0))
             for s in steps]
    busy = sum(d for _, d in usage)
    out["kv_usage_peak"] = max((u for u, _ in usage), default=None)
    out["kv_usage_mean"] = sum(u * d for u, d in usage) / busy if busy > 0 else None
    out["engine_steps"] = len(steps)
    out["busy_s"] = busy
    split = phase_split(steps) if steps else None
    if split is not None:
        out.update(split)
    out.update(run_costs(out["output_tok_s"], price_per_hour, watts, split))
    out.pop("price_per_hour")
    out.pop("watts")
    return out


def perplexity(eng: _Engine, ids: list[int]) -> float | None:
    if len(ids) < 2:
        return None
    lps = eng.score(ids)
    if not lps:
        return None
    return math.exp(-sum(lps) / len(lps))


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeated runs, plus min/max/std of the headline metrics."""
    out: dict[str, Any] = {}
    keys = [k for k in runs[0] if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                                      for r in runs)]
    for k in keys:
        out[k] = statistics.median(r[k] for r in runs)
    for k in runs[0]:
        if k not in out:
            vals = [r.get(k) for r in runs if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals and all(isinstance(v, (int, float)) for v in vals) else None
    for k in SPREAD_KEYS:
        s = spread([r.get(k) for r in runs if r.get(k) is not None])
        out[f"{k}_min"], out[f"{k}_max"], out[f"{k}_std"] = s["min"], s["max"], s["std"]
    return out


def _is_quantised(settings: dict) -> bool:
    return any(settings.get(k, v) != v for k, v in QUANT_DEFAULTS.items())


# ----------------------------------------------------------------------------- progress
class _TextProgress:
    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.n, self._last = desc, total, 0, 0.0

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last > 1.0 or self.n >= self.total:
            self._last = time.monotonic()
            print(f"\r{self.desc}: {self.n}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


class _Checked:
    """A progress bar that also checks for cancellation at each finished request."""

    def __init__(self, bar, check: Callable[[], None]):
        self.bar, self.check = bar, check

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        self.check()


def _make_progress(progress, total: int):
    if progress is False or progress is None:
        return NoProgress()
    if callable(progress) and progress is not True:
        return progress("sweep", total)
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="sweep", unit="req", leave=True)
    except ImportError:
        return _TextProgress("sweep", total)


# ----------------------------------------------------------------------------- results
class SweepResult(list):
    """The records of a sweep, one per grid point (a list of dicts), with tables, plots and
    `apply`. Attributes: `engine`, `grid`, `workload` (definition), `run_id` (the run log's sweep
    row), `price_per_hour`, `watts`, `baseline_ppl`, `status`."""

    def __init__(self, records=(), *, engine=None, grid=None, workload=None, run_id=None, price_per_hour=None,
                 watts=None, baseline_ppl=None, status="completed", key=None):
        super().__init__(records)
        self.engine, self.grid, self.workload, self.run_id = engine, grid, workload, run_id
        self.price_per_hour, self.watts, self.baseline_ppl = price_per_hour, watts, baseline_ppl
        self.status, self.key = status, key

    def __repr__(self) -> str:
        return f"SweepResult({len(self)} points, run_id={self.run_id}, status={self.status!r})"

    def _find(self, point) -> dict:
        if isinstance(point, dict):
            return point
        if isinstance(point, bool):
            raise TypeError("point must be an index, a label or a record")
        if isinstance(point, int):
            return self[point]
        if isinstance(point, str):
            for r in self:
                if r["label"] == point:
                    return r
            raise KeyError(f"no point labelled {point!r}; labels: {[r['label'] for r in self]}")
        raise TypeError("point must be an index, a label or a record")

    def apply(self, point, engine=None) -> dict:
        """Configure the engine with a point's settings (index, label or record); returns the
        effective settings."""
        rec = self._find(point)
        engine = engine if engine is not None else self.engine
        if engine is None:
            raise ValueError("no engine to apply to: pass engine=")
        return engine.configure(**rec["point"])

    def rows(self, columns: Sequence[str] = TABLE_COLUMNS) -> list[dict[str, Any]]:
        keys = list(dict.fromkeys(k for r in self for k in r["point"]))
        rows = []
        for r in self:
            row = {"label": r["label"], **{k: r["point"].get(k) for k in keys}}
            for c in columns:
                v = r.get(c)
                row[c] = ", ".join(v) if isinstance(v, list) else v
            rows.append(row)
        return rows

    def table(self, columns: Sequence[str] = TABLE_COLUMNS):
        """One row per point: its settings and metrics (a DataFrame when pandas is installed)."""
        return _frame(self.rows(columns))

    def cost_table(self):
        """Cost per million output tokens and energy per token, end to end and per phase."""
        return _frame(self.rows(COST_COLUMNS))

    def pareto(self, latency: str | None = None) -> list[dict]:
        """Records on the front: all objectives, or throughput vs `latency` ("ttft_p99_ms", ...)."""
        flag = "pareto" if latency is None else f"pareto_{latency.removesuffix('_ms')}"
        return [r for r in self if r.get(flag)]

    def noise_report(self) -> str:
        lines = []
        for r in self:
            if r.get("noisy"):
                lines.append(f"{r['label']}: throughput {r['output_tok_s_min']:.1f}-{r['output_tok_s_max']:.1f} tok/s "
                             f"overlaps {', '.join(r['overlaps'])}")
        return "\n".join(lines) or "no overlapping spreads"

    def plot(self, **kwargs):
        """Bokeh layout: throughput vs p99 TTFT and vs p99 ITL, fronts highlighted, hover settings."""
        from .sweep_plots import pareto_plot

        return pareto_plot(self, **kwargs)

    def widget(self, engine=None):
        """The plot with a point picker and an "Apply to engine" button (ipywidgets)."""
        from .sweep_plots import widget

        return widget(self, engine=engine if engine is not None else self.engine)

    def show(self, engine=None) -> None:
        """Display `widget()`: the Pareto plots, a point picker and the "Apply to engine" button."""
        from IPython.display import display

        display(self.widget(engine))

    def _repr_html_(self) -> str:
        rows = self.rows()
        if not rows:
            return "<i>empty sweep</i>"
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            "<tr" + (' style="font-weight:bold"' if r.get("pareto") else "") + ">"
            + "".join(f"<td>{html.escape(_cell(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
        return (f"<div><b>sweep</b> ({len(self)} points, {self.status}; bold: Pareto front; noisy: throughput spread "
                f"overlaps another point)<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


class Rows(list):
    """Plain row dicts (what `table()` gives without pandas) that render as an HTML table."""

    def _repr_html_(self) -> str:
        if not self:
            return "<i>no rows</i>"
        cols = list(dict.fromkeys(k for r in self for k in r))
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in cols) + "</tr>"
                       for r in self)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def _frame(rows: list[dict]):
    try:
        import pandas as pd
    except ImportError:
        return Rows(rows)
    return pd.DataFrame(rows)


def _record_from_row(row: dict) -> dict | None:
    extra = row.get("extra") or {}
    metrics = row.get("metrics") or {}
    if "point" not in extra or not metrics:
        return None
    rec = {"index": extra.get("index"), "label": extra.get("label"), "point": extra["point"], **extra["point"],
           **metrics, "settings": row.get("settings"), "run_id": row["id"], "key": row.get("key"),
           "configure_s": extra.get("configure_s"), "resumed": True}
    return rec


# ----------------------------------------------------------------------------- the sweep
def sweep(engine, grid: dict[str, Sequence[Any]], workload=None, *, repeats: int = 1, warmup: int = 2,
          resume: bool | Sequence[dict] = True, price_per_hour: float | None = None, watts: float | None = None,
          max_tokens: int = DEFAULT_MAX_TOKENS, ppl_tokens: int = 256, reset_prefix_cache: bool = True,
          progress=True, record: bool = True, run_log: str | RunLog | None = None,
          on_point: Callable[[dict], Any] | None = None, cancel: threading.Event | None = None) -> SweepResult:
    """Measure `workload` at every point of `grid` on the running `engine`; one record per point.

    repeats: measured runs per point (spread and noise flags need >= 2). warmup: short warm-up
    requests after each configure (0: none). resume: True reuses the points of the same sweep
    already in the run log; a previous result (list of records) reuses its points; False measures
    all. price_per_hour / watts: the machine's (defaults in `workbench.costs`). max_tokens: output
    length of prompt-list workloads. ppl_tokens: tokens of workload text scored for perplexity at
    quantised points (0: skip). progress: True (tqdm), False, or a factory `(desc, total) -> bar`.
    record: write the run log (`run_log`: a path or RunLog; default `workbench.runs.default_path()`).
    on_point: called with each finished record. cancel: a threading.Event that stops the sweep like
    Ctrl-C when set (what `asweep` uses).
    See the module doc for what is measured and how interrupts and resume behave.
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    eng = _Engine(engine, cancel)
    original = eng.settings()
    points = grid_points(grid)
    status = eng.status()
    device = str(status.get("device", "cpu"))
    prices = resolve(price_per_hour, watts, device)
    w = make_sweep_workload(engine, workload, max_tokens=max_tokens, status=status)
    wdef = workload_definition(w)
    grid_keys = list(points[0])
    grid_values = {k: list(dict.fromkeys(p[k] for p in points)) for k in grid_keys}
    base = {k: v for k, v in original.items() if k not in grid_keys}
    identity = {"model": status.get("model"), "weights_checksum": status.get("weights_checksum"), "device": device,
                "workload": wdef["fingerprint"], "repeats": repeats, "warmup": warmup,
                "reset_prefix_cache": reset_prefix_cache}
    sweep_key = _hash({**identity, "base": base, "grid": points})
    if record and (run_log is not None or recording_enabled()):
        log = run_log if isinstance(run_log, RunLog) else RunLog(run_log)
    else:
        log = None

    # -- resume ------------------------------------------------------------------------------------
    reuse: dict[str, dict] = {}
    parent_id = None
    previous_ppl = None
    if isinstance(resume, (list, tuple)):
        reuse = {r["key"]: dict(r, resumed=True) for r in resume if isinstance(r, dict) and r.get("key")}
    elif resume and log is not None:
        try:
            previous = log.find("sweep", sweep_key)
            if previous:
                parent_id = previous[0]["id"]
                previous_ppl = (previous[0].get("metrics") or {}).get("baseline_ppl")
                for child in log.children(parent_id):
                    rec = _record_from_row(child) if child["status"] == "completed" else None
                    if rec is not None:
                        reuse[child["key"]] = rec
                log.reopen(parent_id)
        except Exception as e:  # an unreadable log: measure everything
            warnings.warn(f"run log {log.path}: cannot resume from it ({e})", RuntimeWarning, stacklevel=2)
            parent_id = None
    if parent_id is None:
        parent_id = safe_start(
            log, "sweep", label="sweep " + " x ".join(f"{k}[{len(v)}]" for k, v in grid_values.items()),
            key=sweep_key, model=status.get("model"), weights_checksum=status.get("weights_checksum"), device=device,
            settings=original, workload=wdef,
            extra={"grid": grid_values, "repeats": repeats, "warmup": warmup, **prices})

    todo = []
    for p in points:
        full = {**original, **p}
        todo.append((p, _hash({**identity, "settings": full})))
    measure = [t for t in todo if t[1] not in reuse]
    if reuse and len(measure) < len(todo):
        print(f"sweep: {len(todo) - len(measure)} of {len(todo)} points already measured"
              + (f" (run log sweep #{parent_id})" if parent_id else "") + "; resuming (resume=False measures again)",
              file=sys.stderr)

    ppl_ids: list[int] = []
    if ppl_tokens and any(_is_quantised({**original, **p}) for p, _ in measure):
        for r in w.requests:
            ppl_ids.extend(r.prompt_token_ids)
            if len(ppl_ids) >= ppl_tokens:
                break
        limit = int(status.get("max_model_len") or ppl_tokens)
        ppl_ids = ppl_ids[:min(ppl_tokens, limit)]

    bar = _make_progress(progress, len(measure) * repeats * len(w))
    records: list[dict] = []
    result = SweepResult(engine=engine, grid=grid_values,
                         workload=wdef, run_id=parent_id, price_per_hour=prices["price_per_hour"], watts=prices["watts"],
                         status="running", key=sweep_key)
    touched: set[str] = set()
    outcome, error = "completed", None
    child_id = None
    try:
        baseline_ppl = None
        if ppl_ids:
            need = {k: v for k, v in QUANT_DEFAULTS.items() if original.get(k) != v}
            if need:
                touched |= set(need)
                eng.configure(**need)
            baseline_ppl = perplexity(eng, ppl_ids)
        result.baseline_ppl = baseline_ppl if baseline_ppl is not None else previous_ppl
        ppl_cache: dict[str, float | None] = {}

        for index, (p, key) in enumerate(todo):
            label = point_label(p)
            if key in reuse:
                rec = dict(reuse[key], index=index, label=label)
                records.append(rec)
                if on_point is not None:
                    on_point(rec)
                continue
            eng.check()
            if hasattr(bar, "set_description"):
                bar.set_description(label)
            t0 = time.monotonic()
            touched |= set(p)
            settings_now = eng.configure(**p)
            configure_s = time.monotonic() - t0
            mismatch = {k: (v, settings_now.get(k)) for k, v in p.items() if settings_now.get(k) != v}
            if mismatch:
                raise RuntimeError(f"the engine did not take the settings {mismatch} (asked, got)")
            child_id = safe_start(log, "sweep_point", parent_id=parent_id, label=label, key=key,
                                  model=status.get("model"), weights_checksum=status.get("weights_checksum"),
                                  device=device, settings=settings_now, workload=wdef, facts=False,
                                  extra={"point": p, "label": label, "index": index})
            if warmup:
                warm = [BenchRequest(r.index, r.prompt_token_ids, min(r.max_tokens, 8), 0.0) for r in w.requests[:warmup]]
                eng.run(warm)
            runs = [measure_run(eng, w, progress=bar, reset_prefix_cache=reset_prefix_cache, **prices)
                    for _ in range(repeats)]
            agg = aggregate(runs)
            ppl = None
            if ppl_ids and _is_quantised(settings_now):
                qkey = json.dumps([settings_now.get(k) for k in ("quantization", "quant_group_size", "kv_cache_dtype")])
                if qkey not in ppl_cache:  # the same weights give the same perplexity at every other setting
                    ppl_cache[qkey] = perplexity(eng, ppl_ids)
                ppl = ppl_cache[qkey]
            agg["ppl"] = ppl
            base_ppl = result.baseline_ppl
            agg["delta_ppl"] = ppl - base_ppl if ppl is not None and base_ppl is not None else None
            agg["repeats"] = repeats
            rec = {"index": index, "label": label, "point": p, **p, **agg, "runs": runs, "settings": settings_now,
                   "run_id": child_id, "key": key, "configure_s": configure_s, "resumed": False}
            records.append(rec)
            safe_finish(log, child_id, "completed", metrics={k: v for k, v in rec.items() if k not in (
                "index", "label", "point", "settings", "run_id", "key", "configure_s", "resumed", *p)},
                extra={"point": p, "label": label, "index": index, "configure_s": configure_s})
            child_id = None
            if on_point is not None:
                on_point(rec)
    except KeyboardInterrupt:
        outcome, error = "interrupted", "KeyboardInterrupt"
        raise
    except BaseException as e:
        outcome, error = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        bar.close()
        if child_id is not None:
            safe_finish(log, child_id, outcome, error=error)
        if log is not None and parent_id is not None and outcome != "completed":
            try:  # a point whose row was written just as the interrupt came
                log.finish_children(parent_id, outcome, error)
            except Exception:
                pass
        eng.abort_in_flight()
        restore = {k: original[k] for k in touched}
        if restore:
            _restore(eng, restore)
        result[:] = records
        result.status = outcome
        if records:
            annotate(result)
        best = max((r for r in result if r.get("pareto")), key=lambda r: r.get("output_tok_s") or 0, default=None)
        safe_finish(log, parent_id, outcome, error=error, metrics={
            "points": len(todo), "completed_points": len(result),
            "measured_now": sum(not r.get("resumed") for r in result),
            "best": None if best is None else {k: best.get(k) for k in ("label", "output_tok_s", "ttft_p99_ms",
                                                                        "itl_p99_ms", "cost_per_mtok", "joules_per_token")},
            "pareto": [r["label"] for r in result if r.get("pareto")],
            "noisy": [r["label"] for r in result if r.get("noisy")],
            "baseline_ppl": result.baseline_ppl, **prices})
        _LAST[0] = result
    return result


async def asweep(engine, grid: dict[str, Sequence[Any]], workload=None, **kwargs) -> SweepResult:
    """`sweep` on a worker thread, awaited: the event loop keeps running meanwhile, so a notebook's
    dashboard and widgets stay live (`res = await workbench.sweep.asweep(eng, grid=...)`).
    Cancelling the task or interrupting the kernel stops the sweep as Ctrl-C does (in-flight
    requests aborted, the engine back on its previous settings) and raises KeyboardInterrupt."""
    import asyncio
    import concurrent.futures

    cancel = threading.Event()
    done: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            done.set_result(sweep(engine, grid, workload, cancel=cancel, **kwargs))
        except BaseException as e:  # handed to the awaiting task
            done.set_exception(e)

    threading.Thread(target=work, name="workbench-sweep", daemon=True).start()
    try:
        return await asyncio.shield(asyncio.wrap_future(done))
    except BaseException as e:
        if done.done() and not done.cancelled() and done.exception() is e:
            raise  # the sweep's own error
        cancel.set()  # cancelled from outside: stop the worker and let it restore the engine
        with contextlib.suppress(BaseException):
            done.result(timeout=300)
        raise KeyboardInterrupt("sweep interrupted; the engine is back on the settings it had before") from None


_LAST: list[SweepResult | None] = [None]


def last() -> SweepResult | None:
    """The most recent sweep's records in this process (partial when it was interrupted)."""
    return _LAST[0]


def _restore(eng: _Engine, settings: dict) -> None:
    """Put the engine back; a second Ctrl-C during the restore does not leave it half-way."""
    for attempt in range(3):
        try:
            eng.configure(**settings)
            return
        except KeyboardInterrupt:
            if attempt == 2:
                raise
        except Exception as e:
            warnings.warn(f"sweep: could not restore the engine's settings {settings}: {e}", RuntimeWarning,
                          stacklevel=3)
            return


class _CallableModule(types.ModuleType):
    """`workbench.sweep(...)` calls the function even after `import workbench.sweep` has put this
    module, not the function, on the package."""

    def __call__(self, *args, **kwargs):
        return sweep(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
