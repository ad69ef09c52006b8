"""Packaging of the JupyterLab extension: versions, the wheel's contents, the installed state,
and the frontend's jest units (run through node)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXT = REPO / "extension"
LABEXT = REPO / "workbench" / "labextension"
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _installed() -> bool:
    try:
        importlib.metadata.distribution("serving-workbench")
    except importlib.metadata.PackageNotFoundError:
        return False
    return (Path(sys.prefix) / "share/jupyter/labextensions/serving-workbench/package.json").exists()


def test_one_version_for_wheel_and_extension():
    import workbench

    pkg = json.loads((EXT / "package.json").read_text())
    assert pkg["name"] == "serving-workbench"
    assert pkg["version"] == workbench.__version__
    assert pkg["jupyterlab"]["outputDir"] == "../workbench/labextension"
    assert (EXT / ".yarnrc.yml").read_text().count("nodeLinker: node-modules") == 1
    assert "@jupyter/builder" in pkg["devDependencies"]


def test_extension_hooks_are_cheap_to_import():
    code = (
        "import sys, workbench; "
        "assert workbench._jupyter_server_extension_points() == [{'module': 'workbench.jupyter_server'}]; "
        "assert workbench._jupyter_labextension_paths()[0]['dest'] == 'serving-workbench'; "
        "import workbench.jupyter_server; "
        "heavy = [m for m in ('torch', 'zmq', 'jupyter_server', 'tornado', 'bokeh') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO))
    )


@pytest.mark.skipif(not (LABEXT / "static" / "style.js").exists(), reason="lab extension not built")
@pytest.mark.skipif(
    importlib.util.find_spec("hatch_jupyter_builder") is None
    or importlib.util.find_spec("hatch_nodejs_version") is None,
    reason="needs the test extra (hatch-jupyter-builder, hatch-nodejs-version)",
)
def test_wheel_ships_labextension_and_server_config(tmp_path):
    # The build hook skips npm when the lab extension is already built (skip-if-exists).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("serving_workbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    share = "share/jupyter/labextensions/serving-workbench/"
    assert share + "package.json" in data
    assert share + "install.json" in data
    assert share + "static/style.js" in data
    assert any(n.startswith(share + "static/remoteEntry.") for n in data)
    assert "etc/jupyter/jupyter_server_config.d/workbench.json" in data
    assert "workbench/jupyter_server/handlers.py" in names
    assert not any(n.startswith("workbench/labextension/") for n in names)  # only as shared data
    cfg = json.loads(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("workbench.json"))))
    assert cfg == {"ServerApp": {"jpserver_extensions": {"workbench": True}}}


@pytest.mark.skipif(not _installed(), reason="serving-workbench is not pip-installed in this environment")
def test_installed_extensions_are_enabled():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
    out = subprocess.run(
        [str(BIN / "jupyter"), "labextension", "list"], capture_output=True, text=True, timeout=120, env=env
    )
    text = ANSI.sub("", out.stdout + out.stderr)
    line = next((x for x in text.splitlines() if "serving-workbench" in x), "")
    assert "enabled" in line and "OK" in line, text
    out = subprocess.run(
        [str(BIN / "jupyter"), "server", "extension", "list"], capture_output=True, text=True, timeout=120, env=env
    )
    text = ANSI.sub("", out.stdout + out.stderr)
    assert re.search(r"^\s*workbench enabled", text, re.M), text
    assert re.search(r"workbench \S+ OK", text), text


@pytest.mark.timeout(900)
def test_frontend_units_with_jest():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    jest = EXT / "node_modules" / "jest" / "bin" / "jest.js"
    if not jest.exists():
        jlpm = BIN / "jlpm"
        if not jlpm.exists():
            pytest.skip("no node_modules and no jlpm to install them")
        subprocess.run([str(jlpm), "install"], cwd=EXT, check=True, timeout=600, capture_output=True)
    out = subprocess.run([node, str(jest), "--ci"], cwd=EXT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
