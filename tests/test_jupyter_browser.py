"""`%dashboard` in a real browser: headless Chromium on JupyterLab, a real kernel and engine.

Checks what only a page can show: BokehJS arrives inline (no CDN: the page has no network), the
BokehModel widget renders its canvases, the ipywidgets controls render, and picking a value in
the page's dropdown reaches the engine. Screenshots go to test-artifacts/. Skipped without
Debian's chromium (`make browser`) or Playwright.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest
from jupyter_helpers import (
    CHROMIUM,
    REPO,
    browser_skip_reason,
    free_port,
    notebook,
    private_engine,
    stop_process_group,
    wait_for,
)

ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


if browser_skip_reason():
    pytest.skip(browser_skip_reason(), allow_module_level=True)

CELLS = [
    "%load_ext workbench\n%engine connect dash",
    "%dashboard",
    "%%generate --max-tokens 12 --ignore-eos\nOnce upon a time\n---\nThe capital of France is\n---\nRed, green,"
    "\n---\nWhy is the sky blue?",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("dash-browser")
    with private_engine(base / "rt", None, name="dash", timeout=300) as eng:
        root, cfg, ipy = base / "root", base / "cfg", base / "ipy"
        for d in (root, cfg, ipy):
            d.mkdir()
        (root / "dash.ipynb").write_text(json.dumps(notebook(CELLS)))
        token = "dash-" + os.urandom(6).hex()
        port = free_port()
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(cfg), IPYTHONDIR=str(ipy), JUPYTER_RUNTIME_DIR=str(base / "jrt"))
        log = open(base / "lab.log", "wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                f"--port={port}",
                "--ServerApp.ip=127.0.0.1",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
                "--allow-root",
                "--ServerApp.port_retries=0",
            ],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:

            def up():
                try:
                    with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                        return r.status == 200
                except OSError:
                    return False

            wait_for(up, 90, "jupyter lab to answer", every=0.3)
            yield {"url": url, "token": token, "engine": eng}
        finally:
            stop_process_group(proc)
            log.close()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(base / "lab.log", ARTIFACTS / "dashboard-lab.log")


def test_dashboard_renders_and_a_dropdown_reaches_the_engine(setup):
    from playwright.sync_api import sync_playwright

    eng = setup["engine"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
        page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.set_default_timeout(30_000)
        try:
            page.goto(f"{setup['url']}/lab/tree/dash.ipynb?token={setup['token']}&reset", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_selector("text=Python 3 (ipykernel) | Idle", timeout=90_000)
            first = page.locator(".jp-Notebook .jp-Cell").first
            for _attempt in range(3):
                first.click()
                page.keyboard.press("Escape")
                for _ in CELLS:
                    page.keyboard.press("Shift+Enter")
                try:
                    page.wait_for_function(
                        "el => /\\[(\\d+|\\*)\\]/.test(el.textContent)",
                        arg=first.locator(".jp-InputPrompt").element_handle(),
                        timeout=15_000,
                    )
                    break
                except Exception:  # noqa: BLE001 - the kernel was not ready: again
                    continue
            dash = page.locator(".jp-Notebook .jp-Cell").nth(1)
            dash.locator("select").first.wait_for(timeout=90_000)  # the ipywidgets controls
            dash.locator(".bk-Canvas, canvas").first.wait_for(state="attached", timeout=60_000)
            assert "Could not create a view" not in dash.text_content()
            assert "Error displaying widget" not in dash.text_content()
            page.wait_for_function("() => window.Bokeh !== undefined")
            # the third cell's requests show up in the dashboard's plots
            page.locator(".jp-Notebook .jp-Cell").nth(2).locator("text=finish: length").first.wait_for(timeout=180_000)
            # four prompts, four lanes, each named by its prompt (the lanes source of the dashboard)
            lanes_js = """() => {
                for (const d of window.Bokeh.documents) for (const m of d.all_models)
                    if (m.type === 'ColumnDataSource' && m.data.lane && m.data.label && m.data.tokens) {
                        const out = {};
                        m.data.label.forEach((l, i) => { (out[l] = out[l] || new Set()).add(m.data.lane[i]); });
                        return Object.fromEntries(Object.entries(out).map(([k, v]) => [k, [...v]]));
                    }
                return null; }"""
            prompts = ["Once upon a time", "The capital of France is", "Red, green,", "Why is the sky blue?"]
            lanes = wait_for(
                lambda: (lambda got: got if got and all(p in got for p in prompts) else None)(page.evaluate(lanes_js)),
                30,
                "a lane per prompt in the dashboard",
            )
            assert sorted(lanes[p][0] for p in prompts) == [0, 1, 2, 3] and all(len(lanes[p]) == 1 for p in prompts)
            # and the plot shows all four: its (flipped) y range reaches past the fourth lane
            y_start = page.evaluate("""() => {
                for (const d of window.Bokeh.documents) for (const m of d.all_models)
                    if (m.type === 'Range1d' && m.end === -0.6) return m.start;
                return null; }""")
            assert y_start is not None and y_start >= 4.5, y_start
            # the host plot next to the timeline fills from the engine's metrics, once a second
            host_js = """() => {
                for (const d of window.Bokeh.documents) for (const m of d.all_models)
                    if (m.type === 'ColumnDataSource' && m.data.host_mem_pct)
                        return m.data.host_mem_pct.filter(v => v > 0).length;
                return 0; }"""
            wait_for(lambda: page.evaluate(host_js) >= 2, 30, "host memory rows on the dashboard")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            # pick "static" in the batching dropdown, as a user would
            select = dash.locator(".widget-dropdown", has_text="batching").locator("select")
            options = select.locator("option").all_text_contents()
            assert options == ["continuous", "static", "off"], options
            select.select_option("static")
            wait_for(lambda: eng.settings()["batching"] == "static", 20, "the dropdown to reach the engine")
            # the change is a marker on the dashboard's timeline: what changed and who changed it
            marks_js = """() => {
                for (const d of window.Bokeh.documents) for (const m of d.all_models)
                    if (m.type === 'ColumnDataSource' && m.data.apply_ms) return [m.data.label, m.data.by];
                return null; }"""
            marks = wait_for(
                lambda: (lambda got: got if got and got[0] else None)(page.evaluate(marks_js)),
                20,
                "the change marker on the dashboard",
            )
            assert marks[0][-1] == "batching: 'continuous' → 'static'" and marks[1][-1].startswith("notebook kernel")
            eng.configure(batching="continuous")
            page.wait_for_function(
                "el => el.value !== undefined && el.selectedIndex === 0", arg=select.element_handle(), timeout=20_000
            )  # and back, from the engine
        except BaseException:
            try:
                page.screenshot(path=str(ARTIFACTS / "dashboard-failure.png"), full_page=True)
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            (ARTIFACTS / "dashboard-console.txt").write_text("\n".join(problems))
            browser.close()
    cdn = [x for x in problems if "cdn.bokeh.org" in x or "unpkg" in x or "jsdelivr" in x]
    assert not cdn, cdn
