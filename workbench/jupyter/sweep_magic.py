"""`%sweep` / `%%sweep`: run `workbench.sweep` on the kernel's engine from a notebook.

    %sweep batching=continuous,static max_num_seqs=4,16 --repeats 2 --requests 16
    %%sweep batching=continuous,static --max-tokens 32
    Tell me a story about a robot.
    ---
    Summarise the plot of Hamlet.

Grid entries are `setting=v1,v2,...` (values typed as in `%engine set`). The line form runs the
bench workload (`--requests`, `--prompt-len`, `--output-len`, `--seed`, `--arrival`, `--rate`) or
a workload in a variable (`--workload VAR`: a list of prompts or a bench Workload); the cell form
runs the cell's prompts (separated by lines `---`), each with `--max-tokens` output tokens.

The engine is the kernel's (the one `%engine` uses) or `--engine VAR` (an `EngineClient` or
`LLM` in a variable). The records land in `_sweep` (or `-o VAR`); the cell shows the table and the
Pareto plots with an "Apply to engine" button (`--no-plot`: table only).

In a kernel the sweep runs on a worker thread while the cell awaits it (the magic's cell is
rewritten to top-level `await`, as `%%generate` is), so the dashboard's timeline keeps moving
and the progress bar updates; a kernel interrupt stops the sweep and puts the engine back on
its previous settings. Running the same cell again resumes (`--no-resume` measures again).

Registered by `%load_ext workbench` (its `MAGIC_CLASSES` lists `SweepMagics`); elsewhere
`get_ipython().register_magics(SweepMagics)`.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .parser import MagicArgumentParser


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a = int(lo)
        b = int(hi) if sep else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    return a, b


def sweep_parser() -> MagicArgumentParser:
    p = MagicArgumentParser(
        prog="%sweep",
        description="Measure a workload at every point of a settings grid (grid entries: setting=v1,v2,...).",
    )
    p.add_argument("grid", nargs="*", metavar="setting=v1,v2", help="one grid axis per entry")
    p.add_argument("--repeats", type=int, default=2, help="measured runs per point (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests after each configure (default 2)")
    p.add_argument("--requests", type=int, default=None, help="bench workload: number of requests (default 16)")
    p.add_argument("--prompt-len", type=_range, default=None, metavar="LO-HI", help="bench workload prompt tokens")
    p.add_argument("--output-len", type=_range, default=None, metavar="LO-HI", help="bench workload output tokens")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default 0)")
    p.add_argument("--arrival", choices=["all", "poisson", "bursty"], default=None)
    p.add_argument("--rate", type=float, default=None, help="poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt of a prompt list")
    p.add_argument("--workload", default=None, metavar="VAR", help="a variable holding the workload")
    p.add_argument("--engine", default=None, metavar="VAR", help="a variable holding the engine (default: %%engine's)")
    p.add_argument("--price", type=float, default=None, help="machine price per hour (USD)")
    p.add_argument("--watts", type=float, default=None, help="machine power draw (W)")
    p.add_argument("--no-resume", action="store_true", help="measure every point again")
    p.add_argument(
        "--simulate-first",
        action="store_true",
        help="predict every point with the simulator (calibrated on the engine) and measure only the "
        "predicted Pareto front",
    )
    p.add_argument("--no-record", action="store_true", help="do not write the run log")
    p.add_argument("--no-plot", action="store_true", help="show the table only")
    p.add_argument("-o", "--output", dest="var", default="_sweep", metavar="VAR", help="store the records in VAR")
    return p


def parse_grid(entries: list[str]) -> dict[str, list[Any]]:
    from ..settings import parse_value

    grid: dict[str, list[Any]] = {}
    for e in entries:
        key, eq, values = e.partition("=")
        if not eq or not values:
            raise UsageError(f"%sweep: grid entries are setting=v1,v2,...; got {e!r}")
        key = key.strip().replace("-", "_")
        try:
            grid[key] = [parse_value(key, v) for v in values.split(",")]
        except ValueError as err:
            raise UsageError(f"%sweep: {err}") from None
    if not grid:
        raise UsageError("%sweep: give at least one grid entry, e.g. %sweep batching=continuous,static")
    return grid


def prepare(shell, line: str, cell: str | None) -> tuple[Any, dict[str, Any], argparse.Namespace] | None:
    """(engine, sweep kwargs, parsed args) for a `%sweep` line / `%%sweep` cell."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"%sweep: {e}") from None
    args = sweep_parser().parse_args(words)
    if args is None:  # --help
        return None
    if not args.var.isidentifier():
        raise UsageError(f"-o needs a Python variable name, got {args.var!r}")
    grid = parse_grid(args.grid)
    ns = shell.user_ns if shell is not None else {}
    if args.engine:
        if args.engine not in ns:
            raise UsageError(f"%sweep: no variable {args.engine!r} in the notebook")
        engine = ns[args.engine]
    else:
        from .magics import engine_for_magics

        engine = engine_for_magics(start=False)
    if cell is not None and cell.strip():
        from .generate import split_prompts

        workload: Any = split_prompts(cell)
    elif args.workload:
        if args.workload not in ns:
            raise UsageError(f"%sweep: no variable {args.workload!r} in the notebook")
        workload = ns[args.workload]
    else:
        workload = {
            k: v
            for k, v in (
                ("num_requests", args.requests),
                ("prompt_len", args.prompt_len),
                ("output_len", args.output_len),
                ("seed", args.seed),
                ("arrival", args.arrival),
                ("rate", args.rate),
            )
            if v is not None
        }
    kwargs = dict(
        grid=grid,
        workload=workload,
        repeats=args.repeats,
        warmup=args.warmup,
        resume=not args.no_resume,
        price_per_hour=args.price,
        watts=args.watts,
        max_tokens=args.max_tokens,
        record=not args.no_record,
        simulate_first=args.simulate_first,
    )
    return engine, kwargs, args


def finish(shell, result, args) -> None:
    from IPython.display import display

    if shell is not None:
        shell.user_ns[args.var] = result
    display(result)
    if not args.no_plot and len(result):
        result.show()


class _WidgetProgress:
    """A progress bar drawn on the kernel loop's thread while the sweep runs on a worker."""

    def __init__(self, loop):
        import ipywidgets as W
        from IPython.display import display

        self.loop = loop
        self.bar = W.IntProgress(
            value=0, min=0, max=1, description="sweep", bar_style="info", layout=W.Layout(width="420px")
        )
        self.label = W.HTML("starting…")
        display(W.HBox([self.bar, self.label]))
        self.n, self.total, self.desc = 0, 1, ""

    def __call__(self, desc: str, total: int):  # the factory `sweep(progress=...)` calls
        self.total = max(total, 1)
        self.loop.call_soon_threadsafe(self._draw)
        return self

    def _draw(self) -> None:
        self.bar.max = self.total
        self.bar.value = min(self.n, self.total)
        self.label.value = f"{self.n}/{self.total} requests &nbsp; <code>{self.desc}</code>"

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self.loop.call_soon_threadsafe(self._draw)

    def update(self, n: int = 1) -> None:
        self.n += n
        self.loop.call_soon_threadsafe(self._draw)

    def close(self) -> None:
        def done():
            self._draw()
            self.bar.bar_style = "success" if self.n >= self.total else "warning"

        self.loop.call_soon_threadsafe(done)


async def sweep_cell_async(line: str, cell: str | None = None) -> None:
    """A `%sweep` / `%%sweep` cell run as top-level await (see `_async_sweep`)."""
    import asyncio

    from IPython import get_ipython

    from ..tuning.sweep import asweep

    shell = get_ipython()
    prepared = prepare(shell, line, cell)
    if prepared is None:  # --help
        return
    engine, kwargs, args = prepared
    try:
        progress: Any = _WidgetProgress(asyncio.get_running_loop())
    except ImportError:
        progress = True
    result = await asweep(engine, progress=progress, **kwargs)
    finish(shell, result, args)


@magics_class
class SweepMagics(Magics):
    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        if shell is not None:
            _install_async_sweep(shell)

    @line_cell_magic
    def sweep(self, line: str = "", cell: str | None = None):
        """Sweep a settings grid on the engine: `%sweep --help`."""
        from ..tuning.sweep import sweep as run_sweep

        prepared = prepare(self.shell, line, cell)
        if prepared is None:  # --help
            return None
        engine, kwargs, args = prepared
        result = run_sweep(engine, **kwargs)
        finish(self.shell, result, args)
        return None


def register(ipython) -> None:
    """Register `%sweep` in a shell (what `%load_ext workbench` does through MAGIC_CLASSES)."""
    ipython.register_magics(SweepMagics)


# -- %sweep as top-level await -------------------------------------------------------------------
def _install_async_sweep(shell) -> None:
    from .cells import install_input_transform

    install_input_transform(shell, _async_sweep)


def _async_sweep(lines: list[str]) -> list[str]:
    """A cell that is `%%sweep ARGS` + prompts, or only a `%sweep ARGS` line, -> `await` of the
    same sweep, when the shell runs top-level await on asyncio (a kernel)."""
    if not lines:
        return lines
    first = lines[0].rstrip("\r\n")
    if first.startswith("%%sweep") and (first == "%%sweep" or first[7:8] in (" ", "\t")):
        args, body = first[len("%%sweep") :].strip(), "".join(lines[1:])
    elif first.startswith("%sweep") and first[6:7] in (" ", "\t", "") and not "".join(lines[1:]).strip():
        args, body = first[len("%sweep") :].strip(), None
    else:
        return lines
    from .cells import runs_asyncio_await

    if not runs_asyncio_await():
        return lines
    return [f"await __import__('workbench.jupyter.sweep_magic', fromlist=['_']).sweep_cell_async({args!r}, {body!r})\n"]
