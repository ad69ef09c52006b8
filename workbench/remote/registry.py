"""Named remote servers: an OpenAI-compatible server given an engine name.

Everything that attaches by name (the lab panel's server extension, `%engine connect NAME`,
`EngineClient.connect(NAME)`) reaches it: its entry is a small JSON file beside the engines'
connection files, {"name", "remote_url", "model"}.
"""

from __future__ import annotations

import json
import os

from .wire import split_url


def register_remote(name: str, url: str, *, model: str | None = None, api_key: str | None = None) -> str:
    """Give the OpenAI-compatible server at `url` the engine name `name`; returns the entry's path
    (mode 0600, like the engines' connection files, since it may hold the API key). A local
    engine started later under the same name replaces the entry."""
    from ..ipc import connection as conn

    conn.check_name(name)
    split_url(url)  # validates
    holder = conn.live_engine(name)
    if holder is not None:
        raise FileExistsError(f"an engine named {name!r} is already running (pid {holder.pid}); choose another name")
    path = conn.connection_path(name)
    tmp = path.with_name(f".{name}.remote.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"name": name, "remote_url": url, "model": model, "api_key": api_key, "version": 1}, f)
    os.replace(tmp, path)
    return str(path)


def unregister_remote(name: str) -> None:
    from ..ipc import connection as conn

    if registered_remote(name) is not None:
        conn.connection_path(name).unlink(missing_ok=True)


def registered_remote(name_or_file) -> dict | None:
    """RemoteEngineClient arguments ({"url", "model", "api_key"}) registered under an engine name
    or entry file, else None."""
    from ..ipc import connection as conn

    try:
        text = os.fspath(name_or_file)
        path = text if (os.sep in text or text.endswith(".json")) else conn.connection_path(text)
        with open(path) as f:
            entry = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("remote_url"), str):
        return None
    return {
        "url": entry["remote_url"],
        "model": entry.get("model"),
        "api_key": entry.get("api_key"),
        "name": entry.get("name"),
    }


def list_remotes() -> list[dict]:
    """Registered remote servers: [{"name", "url", "model"}]."""
    from ..ipc import connection as conn

    out = []
    for p, entry in conn.runtime_json():
        if isinstance(entry, dict) and isinstance(entry.get("remote_url"), str):
            out.append({"name": entry.get("name") or p.stem, "url": entry["remote_url"], "model": entry.get("model")})
    return out
