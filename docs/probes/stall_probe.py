"""A stream's worst gap while oversized prompts arrive from another client (the issue-18 "before"
figure; `workbench bench --scenario stall` measures the same on the current code).

    python docs/probes/stall_probe.py
"""

import threading
import time

from workbench import SamplingParams
from workbench.ipc.client import EngineClient
from workbench.ipc.launch import start_engine

eng = start_engine(None, name="stallprobe")
other = EngineClient.connect("stallprobe")
times: list[float] = []


def streamer() -> None:
    for _ in eng.stream("Once upon a time", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)):
        times.append(time.monotonic())


thread = threading.Thread(target=streamer)
thread.start()
time.sleep(1.5)
start = time.monotonic()
errors = []
for name, text in [("8MiB", "word " * ((8 << 20) // 5)), ("600Kchar", "word " * (600_000 // 5))]:
    for _ in range(3):
        try:
            other.generate(text, SamplingParams(max_tokens=1))
            errors.append((name, "accepted"))
        except ValueError as e:
            errors.append((name, str(e)[:90]))
end = time.monotonic()
thread.join()
gaps = [b - a for a, b in zip(times, times[1:])]
during = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
p50 = sorted(gaps)[len(gaps) // 2]
print(
    f"itl p50 {p50 * 1e3:.2f} ms, worst gap during {max(during) * 1e3:.1f} ms ({max(during) / p50:.1f}x), "
    f"attack {end - start:.2f} s"
)
for e in errors:
    print(" ", e)
other.close()
eng.shutdown()
