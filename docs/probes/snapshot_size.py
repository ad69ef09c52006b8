"""Size of the lab panel's first websocket message after a long, wide history (the old raw window,
and the coalescer's snapshots as sent: reducer columns, steps without their batch).

    python docs/probes/snapshot_size.py
"""

import json

import msgspec

from workbench import SamplingParams
from workbench.ipc.launch import start_engine
from workbench.jupyter_server.coalesce import EventCoalescer, trim_timeline

eng = start_engine(None, name="snapsize")
for _ in range(12):
    eng.generate(["Once upon a time"] * 64, SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True))
timeline = msgspec.to_builtins(eng.timeline())
print("buffer:", len(timeline["steps"]), "steps,", len(timeline["requests"]), "request events")
base = {"status": eng.status(), "settings": eng.settings(), "metrics": eng.metrics()}
part, _ = trim_timeline(timeline, 3000, 12000, None)
print(f"raw window of 3000 steps (before issue 18): {len(json.dumps({'timeline': part, **base})) / 1e6:.2f} MB")
for window in (500, 2000):
    msg = EventCoalescer().snapshot(engine="snapsize", timeline=timeline, now=0.0, window=window, **base)
    lanes = len(msg["columns"]["lanes"]["left"])
    print(
        f"snapshot, window {window}: {len(msg['timeline']['steps'])} steps, {lanes} lane rectangles, "
        f"{len(json.dumps(msg)) / 1e6:.2f} MB"
    )
eng.shutdown()
