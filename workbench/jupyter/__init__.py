"""Jupyter front end: `%load_ext workbench` magics, the dashboard, timeline views, `workbench lab`.

Modules: `magics` (the magics and their registry), `session` (which engine this kernel uses),
`generate` (what `%%generate` runs), `reducer` (engine events -> plot columns, pure),
`views` (Bokeh figures), `dashboard` (widgets bound to the engine), `lab` (`workbench lab`).
"""

from __future__ import annotations


def engine(*, start: bool = False):
    """The engine client this kernel's magics use (`start=True`: start the embedded default
    when none runs). Same object as `%engine`, `%%generate` and `%dashboard` talk to."""
    from .session import get_session

    return get_session().require(start=start)
