"""The kernel websocket connection, less one race of jupyter_server's.

When the server closes a kernel websocket (a newer connection takes over the same session, or a
ping goes unanswered), tornado waits up to 5 s for the browser's close frame before it calls
`on_close`; until then the connection's ZeroMQ streams still deliver the kernel's messages, and
jupyter_server writes them to the closing socket from paths that do not expect it to be closed
(the v1 protocol's reply path, the iopub rate limiter's notice). Each raises WebSocketClosedError
out of the ZeroMQ callback: a traceback in the lab's log for every such message. A `%dashboard`
or a streaming `%%generate` sends many, so a closed or reloaded page printed a screenful. Those
messages are for a browser that is gone: they are dropped, as jupyter_server's own legacy-protocol
path already does. A write that starts while the socket is open and fails when it closes fails
later, in the future tornado returns, which jupyter_server never awaits: asyncio then logged
"Task exception was never retrieved" with the traceback. That failure is retrieved here too.
"""

from __future__ import annotations

from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado.websocket import WebSocketClosedError


class KernelSocketConnection(ZMQChannelsWebsocketConnection):
    @property
    def write_message(self):
        return dropping_when_closed(self.websocket_handler.write_message, self.log, f"kernel {self.kernel_id}")


def dropping_when_closed(write, log, who: str):
    """`write` (a websocket's write_message) that drops a message for a closed socket, whether it
    is closed already or closes while the message is sent."""

    def write_unless_closed(message, binary: bool = False):
        try:
            pending = write(message, binary=binary)
        except WebSocketClosedError:
            log.debug("%s: message dropped, its websocket is closing", who)
            return None
        if pending is not None:
            pending.add_done_callback(retrieve)
        return pending

    def retrieve(pending) -> None:
        # retrieving the exception is what keeps asyncio from logging it at garbage collection
        error = None if pending.cancelled() else pending.exception()
        if isinstance(error, WebSocketClosedError):
            log.debug("%s: message dropped, its websocket closed while it was sent", who)
        elif error is not None:
            log.error("%s: a websocket write failed", who, exc_info=error)

    return write_unless_closed


def use_for(serverapp) -> None:
    """Make the server's kernel websockets this connection, unless it was configured with another."""
    settings = serverapp.web_app.settings
    if settings.get("kernel_websocket_connection_class") is ZMQChannelsWebsocketConnection:
        settings["kernel_websocket_connection_class"] = KernelSocketConnection
