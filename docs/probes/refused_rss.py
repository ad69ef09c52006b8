"""Engine memory and responsiveness after 1,000 prompts of 8 MiB, each refused.

python docs/probes/refused_rss.py
"""

import time

from workbench import SamplingParams
from workbench.ipc.launch import start_engine


def rss(pid):
    return int([x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS")][0].split()[1]) // 1024


eng = start_engine(None, name="rssprobe")
eng.generate("hi", SamplingParams(max_tokens=4))
print("rss before", rss(eng.pid), "MB")
text = "word " * ((8 << 20) // 5)
t = time.monotonic()
for _ in range(1000):
    try:
        eng.generate(text, SamplingParams(max_tokens=1))
    except ValueError:
        pass
print("1000 x 8 MiB refused in", round(time.monotonic() - t, 1), "s; rss after", rss(eng.pid), "MB")
t = time.monotonic()
eng.status()
print("status answered in", round((time.monotonic() - t) * 1e3, 1), "ms")
eng.shutdown()
