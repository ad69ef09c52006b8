"""The control for `--scenario stall`: a stream's worst gap beside one busy-looping process for
1.3 s (the floor that CPU sharing sets on a 2-core host).

    python docs/probes/busy_control.py
"""

import subprocess
import sys
import threading
import time

from workbench import SamplingParams
from workbench.ipc.launch import start_engine

HOG = (
    "import time, sys\nsys.stdin.readline()\nt = time.monotonic()\nwhile time.monotonic() - t < 1.3: pass\n"
    "print(t, time.monotonic(), flush=True)"
)
eng = start_engine(None, name="busycontrol")
for _ in range(2):
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    times: list[float] = []
    params = SamplingParams(max_tokens=700, temperature=0, ignore_eos=True)
    thread = threading.Thread(
        target=lambda times=times, params=params: times.extend(
            time.monotonic() for _ in eng.stream(prompt_token_ids=[1, 2, 3, 4], params=params)
        )
    )
    thread.start()
    time.sleep(1.0)
    hog.stdin.write("go\n")
    hog.stdin.flush()
    a, b = map(float, hog.stdout.readline().split())
    thread.join()
    gaps = [y - x for x, y in zip(times, times[1:])]
    during = [y - x for x, y in zip(times, times[1:]) if y >= a and x <= b]
    p50 = sorted(gaps)[len(gaps) // 2]
    print(f"one busy process: itl p50 {p50 * 1e3:.1f} ms, worst {max(during) * 1e3:.1f} ms ({max(during) / p50:.1f}x)")
eng.shutdown()
