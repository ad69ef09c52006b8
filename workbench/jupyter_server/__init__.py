"""Jupyter server extension: REST + websocket bridge between JupyterLab and workbench engines.

Enabled by `jupyter-config/jupyter_server_config.d/workbench.json` (installed with the
package); `workbench._jupyter_server_extension_points` points the server here. Importing this
package is cheap: the handlers (and the ZeroMQ client) load when the server loads the extension.

Engines started from the lab panel are tied to the server's process (they stop when it exits);
the engine clients close at interpreter exit (`workbench.ipc.client` registers that).
"""

from __future__ import annotations


def _load_jupyter_server_extension(serverapp) -> None:
    from .handlers import setup_handlers

    hub = setup_handlers(serverapp.web_app)
    serverapp.log.info("Serving Workbench server extension loaded (engines in %s)", hub.runtime_dir())
