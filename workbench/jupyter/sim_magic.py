"""`%simulate`: the serving simulator from a notebook, with the options of `workbench simulate`.

    %simulate --profile h100 --requests 500 --rate 20 --replicas 2 --slo-ttft-ms 500
    %simulate --calibrate --requests 64 --rate 4          # fitted on the kernel's engine first
    %simulate --replicas-for --slo-ttft-ms 300 --slo-itl-ms 50 --rate 40 -o res

Prints the summary and draws the simulated timeline with the same view as `%timeline`; the
`SimResult` lands in `_simulation` (or `-o VAR`). `--calibrate` fits on the kernel's engine (the
one `%engine` uses).
"""

from __future__ import annotations

import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from ..settings import add_setting_flags, settings_from_flags
from .parser import MagicArgumentParser


def simulate_parser() -> MagicArgumentParser:
    from ..sim.cli import DESCRIPTION, add_simulate_arguments

    p = MagicArgumentParser(prog="%simulate", description=DESCRIPTION)
    add_simulate_arguments(p, calibrate_help="fit the step costs from the kernel's engine (a short calibration run)")
    p.add_argument("-o", "--output", default="_simulation", metavar="VAR", help="variable for the SimResult")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="the summary only")
    add_setting_flags(p, "engine settings the simulated replicas run with")
    return p


@magics_class
class SimulateMagics(Magics):
    @line_magic
    def simulate(self, line: str = ""):
        """%simulate [options]: simulate serving a workload (see `%simulate --help`)."""
        from ..sim.cli import format_report, simulate_from_args

        args = simulate_parser().parse_args(shlex.split(line))
        if args is None:  # --help
            return
        engine = None
        if args.calibrate:
            from .magics import engine_for_magics

            engine = engine_for_magics()
        try:
            report, res = simulate_from_args(args, settings_from_flags(args), engine)
        except (ValueError, TypeError, FileNotFoundError) as e:
            raise UsageError(f"%simulate: {e}") from None
        self.shell.user_ns[args.output] = res
        print(format_report(report))
        if args.plot:
            from IPython.display import display

            from .reducer import TimelineReducer
            from .views import static_timeline, to_columns

            red = TimelineReducer()
            n = len(res.replicas)
            red.add(res.merged_timeline() if n > 1 else res.timeline)  # a band per replica
            red.tick(float("inf"), grace=0)
            display(
                static_timeline(
                    to_columns(red),
                    red.num_lanes,
                    lane_labels=red.lane_labels,
                    title=f"Simulated timeline ({n} replica{'s' if n > 1 else ''})",
                ).widget()
            )
