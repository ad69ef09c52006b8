"""The HTTP front under bad input and SIGTERM: seed 2**64, NaN, 20 stop strings, a 15 MiB prompt,
then SIGTERM during a long stream with the given drain deadline.

    python docs/probes/http_probe.py DRAIN_SECONDS
"""

import signal
import subprocess
import sys
import threading
import time

import httpx

port = 18431
proc = subprocess.Popen(
    [
        sys.executable,
        "-m",
        "workbench.http",
        "--http",
        f"127.0.0.1:{port}",
        "--name",
        "httpprobe",
        "--drain-timeout",
        sys.argv[1],
    ],
    stderr=subprocess.DEVNULL,
)
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(base + "/health").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.2)
r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "seed": 2**64, "max_tokens": 2})
print(r.status_code, r.text[:200])
r = httpx.post(
    base + "/v1/completions",
    content=b'{"prompt": "hi", "temperature": NaN}',
    headers={"content-type": "application/json"},
)
print(r.status_code, r.text[:200])
r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "stop": ["a"] * 20})
print(r.status_code, r.text[:200])
t = time.monotonic()
r = httpx.post(base + "/v1/completions", json={"prompt": "word " * (3 << 20)}, timeout=60)
print(r.status_code, r.text[:200], f"{time.monotonic() - t:.2f} s")
lines: list[str] = []


def stream() -> None:
    body = {"prompt": "Once", "max_tokens": 600, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        lines.extend(line for line in resp.iter_lines() if line)


thread = threading.Thread(target=stream)
thread.start()
time.sleep(2)
proc.send_signal(signal.SIGTERM)
thread.join()
print(len(lines), "lines; the last two:", lines[-2][:200], lines[-1])
print("exit code", proc.wait(30))
