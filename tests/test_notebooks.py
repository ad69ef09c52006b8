"""Every tutorial notebook in notebooks/ runs top to bottom under nbclient without an error.

The notebooks use the embedded default model through `%engine start`, which attaches to the
engine named "default" when one runs: one engine is started here for all of them (as
`workbench lab` does), in a private runtime dir, and stopped at the end whatever happens.
Each notebook puts back the settings it changed, so their order does not matter.
"""

from __future__ import annotations

import json
import time

import pytest
from jupyter_helpers import REPO, private_engine

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ALL_NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# Notebooks with a test of their own (their own engine, run log, checks) are run there instead.
DEDICATED = {"07-tuning.ipynb": "test_notebook_tuning.py", "08-capacity-planning.ipynb": "test_notebook_capacity.py"}
NOTEBOOKS = [p for p in ALL_NOTEBOOKS if p.name not in DEDICATED]
CELL_TIMEOUT = 300


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with private_engine(tmp_path_factory.mktemp("rt-notebooks"), None, name="default", timeout=300) as eng:
        yield eng


def test_the_tutorials_are_there_and_every_notebook_is_run():
    names = {p.name for p in ALL_NOTEBOOKS}
    for name, test in DEDICATED.items():
        if name in names:
            assert (REPO / "tests" / test).exists(), f"{name} is left to {test}, which is missing"
    for required in ("00-quickstart.ipynb", "01-batching.ipynb", "02-chunked-prefill.ipynb",
                     "03-prefix-caching.ipynb", "04-quantisation.ipynb", "05-speculative-decoding.ipynb"):
        assert required in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_clean(engine, path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.monotonic()
    client.execute()
    took = time.monotonic() - t0
    out_dir = REPO / "test-artifacts" / "notebooks"  # the executed copies, for a human to look at
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
    problems = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                problems.append(f"cell {i}: {out.ename}: {out.evalue}")
            elif out.output_type == "stream" and out.name == "stderr" and (
                    "Traceback" in out.text or "Error" in out.text):
                problems.append(f"cell {i} stderr: {out.text[:500]}")
            elif out.output_type in ("display_data", "execute_result"):
                text = json.dumps(out.get("data", {}))
                if "Traceback (most recent call last)" in text:
                    problems.append(f"cell {i} shows a traceback")
    assert not problems, "\n".join(problems)
    settings = engine.settings()
    assert settings["batching"] == "continuous" and settings["speculative"] == "off", \
        f"{path.name} left the shared engine changed: {settings}"
    print(f"{path.name}: {took:.1f} s")
