"""A child process for the log-rotation test: its stdout/stderr are the log file, as an engine's
are under start_engine; it writes past a limit, rotates, writes again."""

import sys

from workbench.ipc.logs import rotate_log

path, limit = sys.argv[1], int(sys.argv[2])
print("x" * (limit + 10), file=sys.stderr, flush=True)
print("first rotation:", rotate_log(path, limit), file=sys.stderr, flush=True)
print("after the rotation", flush=True)
print("small again:", rotate_log(path, limit), file=sys.stderr, flush=True)
