"""08-capacity-planning: runs top to bottom on the shared default engine and its claims hold in the
numbers it prints (prediction errors, replicas vs SLO, the cheaper route, decode-only replicas)."""

from __future__ import annotations

import json
import re

import pytest
from jupyter_helpers import REPO, private_engine

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

PATH = REPO / "notebooks" / "08-capacity-planning.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_capacity_planning_notebook_and_its_claims(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(PATH, as_version=4)
    with private_engine(tmp_path_factory.mktemp("rt-capacity"), None, name="default", timeout=300):
        NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(PATH.parent)}}
        ).execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert "cdn.bokeh.org" not in json.dumps([c.get("outputs", []) for c in nb.cells]), "BokehJS from a CDN"
    out = "\n".join(_text(c) for c in nb.cells)
    # the measured workload is the bench's English text, as the notebook says; calibrating shows progress
    assert "24 requests, prompts from 'text'" in out
    assert "calibrating 1/" in out and "calibrated in" in out
    # predicted vs measured: every error printed, and a calibrated fit is not far off on this host.
    # Throughput sums the whole run and holds within a few percent; the ITL median is a ~13 ms small
    # step, and one slow minute of a shared host moved it by a third in CI (-33%, with throughput 0%
    # and TTFT -6%), so the latencies get a wider band. A fit missing a term is off by 2x or more.
    errs = [int(x) for x in re.findall(r"predicted +[\d.]+ \(([+-]\d+)%\)", out)]
    assert len(errs) == 3, errs
    tok_s, ttft_p50, itl_p50 = errs
    assert abs(tok_s) <= 25 and abs(ttft_p50) <= 50 and abs(itl_p50) <= 50, errs
    # replicas vs SLO: too few fail it, the printed count meets it, more only cost more
    att = {int(n): float(a) for n, a in re.findall(r"(\d) replica\(s\): SLO met by ([\d.]+)%", out)}
    need = int(re.search(r"meeting the SLO for 99% of requests: (\d+)", out).group(1))
    assert att[1] < 50 and need >= 2 and att[need] >= 99 and att[need - 1] < 99
    cost = {int(n): float(c) for n, c in re.findall(r"(\d) replica\(s\):.*\$([\d.]+)/M", out)}
    assert cost[6] > cost[need]
    routed, four = map(
        float, re.search(r"routed: \$([\d.]+)/M tokens; four H100s for everything: \$([\d.]+)/M", out).groups()
    )
    assert routed < four
    assert re.search(r"most tokens for one request in one of them: 1\b", out)
