"""How a magic's cell runs in a kernel, shared by the magics: as top-level `await` on the
kernel's event loop (an input transformer rewrites the cell), and the short messages they show."""

from __future__ import annotations

import html


def install_input_transform(shell, transform) -> None:
    """Add `transform` to the shell's cleanup input transformers, once (shared with `%sweep`)."""
    transforms = getattr(shell, "input_transformers_cleanup", None)
    if transforms is not None and transform not in transforms:
        transforms.append(transform)


def runs_asyncio_await() -> bool:
    """Whether the current shell runs top-level await on asyncio (a kernel, or a shell with
    autoawait on): only then can a magic's cell become an `await`."""
    try:
        from IPython import get_ipython
        from IPython.core.interactiveshell import _asyncio_runner
    except ImportError:  # pragma: no cover
        return False
    ip = get_ipython()
    return not (ip is None or not getattr(ip, "autoawait", False) or ip.loop_runner is not _asyncio_runner)


def show_message(text: str, level: str = "info") -> None:
    from IPython.display import display

    color = {"error": "#b00020", "ok": "#2a7a2a", "warning": "#a35a00"}.get(level, "inherit")
    display({"text/plain": text, "text/html": f'<div style="color: {color};">{html.escape(text)}</div>'}, raw=True)
