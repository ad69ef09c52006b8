"""Jupyter server extension: REST + websocket bridge between JupyterLab and workbench engines.

Enabled by `jupyter-config/jupyter_server_config.d/workbench.json` (installed with the
package); `workbench._jupyter_server_extension_points` points the server here. Importing this
package is cheap: the handlers (and the ZeroMQ client) load when the server loads the extension.

Engines started from the lab panel are tied to the server's process (they stop when it exits);
the engine clients close at interpreter exit (`workbench.ipc.client` registers that).
"""

from __future__ import annotations

import logging


class _PingTimeoutClampNote(logging.Filter):
    """jupyter_server keeps its websocket keep-alive interval and timeout (30 s and 3 pings) in ms
    under properties tornado also reads, as seconds; tornado then warns once that the timeout is
    longer than the interval and clamps its own copy, for pings every 30,000 s that never come.
    jupyter_server's own check uses the values as meant, so that warning says nothing true."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "websocket_ping_timeout" not in record.getMessage()


def _load_jupyter_server_extension(serverapp) -> None:
    from . import kernel_socket
    from .handlers import setup_handlers

    logging.getLogger("tornado.general").addFilter(_PingTimeoutClampNote())
    kernel_socket.use_for(serverapp)

    hub = setup_handlers(serverapp.web_app)
    serverapp.log.info("Serving Workbench server extension loaded (engines in %s)", hub.runtime_dir())
