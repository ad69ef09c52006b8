"""Tuning: sweeps over a settings grid, their Pareto fronts and noise, costs, and plots.

| module | what lives there |
|---|---|
| `sweep.py` | `sweep` / `asweep` / `last`: the grid loop, resume from the run log, interrupts |
| `grid.py` | grid points (re-layout settings vary slowest), labels, shared constants |
| `workload.py` | the workload a sweep runs (bench workloads or the user's prompts) as token ids |
| `measure.py` | one measured run through the workload driver, and what is read around it |
| `result.py` | `SweepResult`: tables, fronts, noise report, `apply` |
| `pareto.py` | Pareto fronts and spread overlap (pure functions) |
| `costs.py` | cost per million tokens and energy per token, end to end and per phase |
| `plots.py` | the Bokeh Pareto plots and the "apply to engine" widget |
"""
