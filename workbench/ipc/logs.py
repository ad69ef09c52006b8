"""The engine process's own log: rotated when it grows past a limit, and a flood of similar lines
(a fuzzer's refused calls) kept to a few a minute."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("workbench.engine")

MAX_LOG_BYTES = 20 << 20  # an engine's log past this moves to NAME.log.1 and a fresh one starts


class QuietLog:
    """Log at INFO at most `burst` lines per `period_s`; the rest are counted and the count is logged
    with the next line that gets through (so a flood of rejections costs a few lines a minute)."""

    def __init__(self, logger: logging.Logger, burst: int = 10, period_s: float = 60.0):
        self.logger, self.burst, self.period_s = logger, burst, period_s
        self._window_start = 0.0
        self._in_window = 0
        self.suppressed = 0

    def note(self, line: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if now - self._window_start >= self.period_s:
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            return False
        self._in_window += 1
        if self.suppressed:
            line += f" ({self.suppressed} similar line(s) suppressed)"
            self.suppressed = 0
        self.logger.info("%s", line)
        return True


def rotate_log(path: str | os.PathLike, limit: int) -> bool:
    """When the log this process writes as its stdout and stderr (start_engine's) has grown past
    `limit` bytes, move it to PATH.1 (replacing the one before) and carry on in a fresh file on the
    same descriptors. Returns whether it rotated."""
    try:
        if os.stat(path).st_size <= limit or os.fstat(2).st_ino != os.stat(path).st_ino:
            return False  # small, or not this process's output (nothing to rotate here)
        sys.stdout.flush()
        sys.stderr.flush()
        os.replace(path, f"{path}.1")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:
        return False
    log.info("log rotated: the previous %d bytes are in %s.1", limit, path)
    return True


def short(value: Any, most: int = 200) -> str:
    """A value for a log line: its repr, cut to `most` characters (a hostile call can be megabytes)."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= most else text[:most] + f"... ({len(text):,} characters)"
