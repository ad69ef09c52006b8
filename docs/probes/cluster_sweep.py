"""A sweep fanned out over a cluster's replicas against the same sweep on one of them, alone.

    .venv/bin/python docs/probes/cluster_sweep.py [--replicas 2] [--requests 16] [--rounds 2]

Starts a local Ray cluster with N replicas of the embedded model, then alternates (rounds
times): the grid max_num_seqs [4, 8, 16, 32] on the cluster (points in parallel, one per
replica) and on replica r0 alone (points one after another). Prints both wall times, their
ratio and each point's tok/s both ways. On one host the replicas share its cores and memory
bandwidth, so the speed-up there is what spare cores allow, not N.
"""

from __future__ import annotations

import argparse
import os
import time

import workbench
from workbench import cluster

GRID = {"max_num_seqs": [4, 8, 16, 32]}


def timed_sweep(engine, requests: int) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    res = workbench.sweep(
        engine,
        grid=GRID,
        workload={"num_requests": requests},
        warmup=1,
        resume=False,
        progress=False,
        record=False,
        ppl_tokens=0,
    )
    return time.perf_counter() - t0, list(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"host: {os.cpu_count()} CPUs; {args.replicas} replicas; grid {GRID}; {args.requests} requests a point")
    c = cluster.start(replicas=args.replicas, name="probe-sweep", host="127.0.0.1")
    try:
        one = c.replica(c.replicas()[0]["name"])
        for r in range(args.rounds):
            fanned, recs_c = timed_sweep(c, args.requests)
            alone, recs_1 = timed_sweep(one, args.requests)
            print(f"round {r}: fan-out {fanned:.1f} s, one replica {alone:.1f} s, speed-up {alone / fanned:.2f}x")
            for a, b in zip(recs_c, recs_1):
                print(
                    f"   {a['label']:>16} on {a.get('replica')}: {a['output_tok_s']:6.1f} tok/s "
                    f"(alone: {b['output_tok_s']:6.1f})"
                )
    finally:
        c.shutdown()


if __name__ == "__main__":
    main()
