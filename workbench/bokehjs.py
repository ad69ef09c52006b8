"""Where a kernel's Bokeh plots load BokehJS from, once per kernel and never from a CDN: below
every module that draws (the notebook views, the run log's and the sweep's plots), so none of
them imports another's front end for it."""

from __future__ import annotations

import os

_BOKEHJS_LOADED = False


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where widgets and BokehJS can render)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


BOKEH_ROOT_ENV = "WORKBENCH_BOKEH_ROOT"  # set by the server extension for the kernels it starts


def bokeh_resources():
    """Where a kernel's plots load BokehJS from, never a CDN (an offline machine has none): the
    server extension's copy of the installed bokeh's files when this kernel runs under it (a
    saved notebook then holds a script tag), else the files inline (a few MB per notebook)."""
    from bokeh.resources import INLINE, Resources

    root = os.environ.get(BOKEH_ROOT_ENV)
    return Resources(mode="server", root_url=root) if root else INLINE


def ensure_bokehjs() -> None:
    """Load BokehJS into the page (`bokeh_resources`), once per kernel; `bokeh.io.show` then
    draws in the notebook."""
    global _BOKEHJS_LOADED
    if _BOKEHJS_LOADED or not in_kernel():
        return
    from bokeh.io import output_notebook

    output_notebook(resources=bokeh_resources(), hide_banner=True)
    _BOKEHJS_LOADED = True
