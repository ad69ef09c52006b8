"""notebooks/07-tuning.ipynb runs top to bottom (nbclient, the embedded default model on a CPU) and
shows what it promises: a 4-point sweep with repeats, the Pareto plot widget and the cost table;
the sweep lands in the run log and the engine ends on the settings it started with."""

import json

import pytest
from jupyter_helpers import REPO, kill_engines_in, private_runtime_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NOTEBOOK = REPO / "notebooks" / "07-tuning.ipynb"


def test_tuning_notebook_is_small_and_ends_in_plot_and_costs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    sweep = next(c for c in code if c.startswith("%sweep"))
    assert "batching=continuous,static" in sweep and "max_num_seqs=4,16" in sweep and "--requests 16" in sweep
    assert code[-2].strip() == "res.show()" and code[-1].strip() == "res.cost_table()"


def test_tuning_notebook_runs(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from workbench.runs import RunLog

    db = tmp_path / "runs.sqlite"
    monkeypatch.setenv("WORKBENCH_RUNS_DB", str(db))  # the kernel inherits both
    monkeypatch.setenv("WORKBENCH_ENGINE", "tuning-notebook")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with private_runtime_dir(tmp_path / "rt"):
        try:
            NotebookClient(
                nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
            ).execute()
        finally:
            kill_engines_in(tmp_path / "rt")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors[0]
    text = json.dumps([o.get("data", {}) for o in outputs] + [o.get("text", "") for o in outputs])
    assert "SweepResult(4 points" in text and "PARETO" in text
    assert "BokehModel" in text  # the Pareto plot widget
    assert "decode_joules_per_token" in text  # the cost table, last
    sweep = RunLog(db).list(kind="sweep")[0]
    assert sweep["status"] == "completed" and sweep["model"] == "smollm2-135m"
    assert len(RunLog(db).children(sweep["id"])) == 4
