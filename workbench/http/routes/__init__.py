"""The HTTP routes: module-level handlers over the app's `Serving` (`request.app.state.serving`),
one router per concern; `create_app` mounts `ROUTERS`. A handler is an ordinary coroutine of a
`Request`, so a test can call it with any app whose state holds a `Serving`."""

from __future__ import annotations

from . import admin, chat, completions, models

ROUTERS = [completions.router, chat.router, models.router, admin.router]  # mounted in this order
