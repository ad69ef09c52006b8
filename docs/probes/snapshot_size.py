"""Size of the lab panel's first websocket message after a long, wide history (old and new windows).

    python docs/probes/snapshot_size.py
"""

import json

import msgspec

from workbench import SamplingParams
from workbench.ipc.launch import start_engine
from workbench.jupyter_server.coalesce import trim_timeline

eng = start_engine(None, name="snapsize")
for _ in range(12):
    eng.generate(["Once upon a time"] * 64, SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True))
timeline = msgspec.to_builtins(eng.timeline())
print("buffer:", len(timeline["steps"]), "steps,", len(timeline["requests"]), "request events")
for window, requests, entries in ((3000, 12000, None), (500, 2000, 8000), (2000, 8000, 32000)):
    part, _ = trim_timeline(timeline, window, requests, entries)
    msg = {"type": "snapshot", "timeline": part, "status": eng.status(), "settings": eng.settings(),
           "metrics": eng.metrics()}
    print(f"window {window} steps: {len(part['steps'])} kept, {len(json.dumps(msg)) / 1e6:.2f} MB")
eng.shutdown()
