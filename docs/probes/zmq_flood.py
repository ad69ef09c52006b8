"""Flood an engine process's ZeroMQ socket without reading the answers, then watch its memory:
status calls, random bytes and (MODE=mix) 2% token-id submits of 1 MiB (500k ids, longer than
the context: refused), for 40 s from one client; the engine's RSS warm (after two batches of
requests), at its peak, after the client left and after serving again.

    python docs/probes/zmq_flood.py [mix|small]
"""

import random
import sys
import time

import msgspec
import zmq

from workbench.ipc import connection as conn
from workbench.ipc.launch import start_engine
from workbench.ipc.protocol import HEADER, Call, encode
from workbench.sampling_params import SamplingParams

mode = sys.argv[1] if len(sys.argv) > 1 else "mix"
eng = start_engine(None, name=f"flood-{int(time.time())}", dtype="float32", timeout=180)
pid = eng.status()["pid"]


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of the engine process, MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def serve() -> None:
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eng.generate(prompt_token_ids=[[5 + i] * 300 for i in range(16)], params=params, timeout=300)


for _ in range(2):
    serve()
print("warm (RSS, peak) MB", rss(), flush=True)
info = conn.read_connection_file(eng.connection_file)
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(info.request_address)
rng = random.Random(1)
big = msgspec.msgpack.encode(["submit", [["x", None, [rng.randrange(5, 40000) for _ in range(500_000)], {}]]])
start, sent, peak = time.time(), 0, 0
while time.time() - start < 40:
    for _ in range(200):
        r = rng.random()
        if mode == "mix" and r < 0.02:
            s.send_multipart([HEADER, big])
        elif r < 0.5:
            s.send_multipart([HEADER, encode(Call(sent, "status"))])
        else:
            s.send_multipart([HEADER, rng.randbytes(rng.randint(1, 300))])
        sent += 1
    peak = max(peak, rss()[0])
print(f"sent {sent} messages; peak RSS {peak} MB", flush=True)
ctx.destroy(linger=0)
time.sleep(10)
print("10 s after the client left", rss(), flush=True)
serve()
print("after serving again", rss(), flush=True)
eng.shutdown(timeout=20)
