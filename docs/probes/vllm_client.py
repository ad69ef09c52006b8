"""vLLM's own load client (`vllm bench serve`, random 256 in / 128 out) against our server and
vLLM's, one after the other on this host, at each request rate given (`inf`: all at once).

    python docs/probes/vllm_client.py [--rates 2,inf] [--prompts 64] [--vllm-python PATH] [--json OUT]

Both servers serve the embedded SmolLM2 in bf16 from the same converted folder; ours is
`workbench serve --http` with its defaults (plus any --setting k=v), vLLM's the CPU build with
the bench's flags (`workbench/bench/vllm_peer.py`). Prints one row per server and rate:
output tok/s, median and p99 TTFT, median TPOT and ITL, and our ratio to vLLM.
"""

import argparse
import json
import sys
import time

from workbench.bench.server_peer import RunningPeer
from workbench.bench.vllm_peer import (
    find_vllm_python,
    run_vllm_client,
    vllm_server,
    vllm_version,
    workbench_http_server,
)
from workbench.models.embedded import ensure_converted
from workbench.models.loader import DEFAULT_MODEL, default_gguf_path
from workbench.runs import machine_facts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="2,inf")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--setting", action="append", default=[], metavar="K=V", help="a setting of our server")
    ap.add_argument("--servers", default="workbench,vllm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    if python is None:
        print("no Python with vLLM: run `make peers` or pass --vllm-python", file=sys.stderr)
        return 2
    hf_dir = str(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    rates = [None if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    settings = dict(kv.split("=", 1) for kv in args.setting)
    out = {"machine": machine_facts()["cpu"], "vllm": vllm_version(python), "settings": settings, "runs": []}
    for server in args.servers.split(","):
        peer = (
            workbench_http_server(None, settings, name=f"vllm-client-{int(time.time())}")
            if server == "workbench"
            else vllm_server(python, hf_dir, name=DEFAULT_MODEL, max_num_seqs=64, max_model_len=2048, threads=2)
        )
        with RunningPeer(peer, lambda m: print(m, file=sys.stderr)):
            served = DEFAULT_MODEL if server == "vllm" else None
            for rate in rates:
                r = run_vllm_client(
                    python,
                    peer.url,
                    model=served or _model_name(peer.url),
                    tokenizer=hf_dir,
                    num_prompts=args.prompts,
                    request_rate=rate,
                )
                r["server"] = server
                out["runs"].append(r)
                print(
                    f"{server:10s} rate {rate or 'inf'}: {r['output_throughput']:.1f} tok/s, TTFT median "
                    f"{r['median_ttft_ms']:.0f} p99 {r['p99_ttft_ms']:.0f} ms, "
                    f"TPOT median {r['median_tpot_ms']:.1f}, "
                    f"ITL median {r['median_itl_ms']:.1f} ms",
                    flush=True,
                )
    for rate in rates:
        pair = {r["server"]: r for r in out["runs"] if r["request_rate"] == rate}
        if len(pair) == 2:
            w, v = pair["workbench"], pair["vllm"]
            print(
                f"rate {rate or 'inf'}: tok/s {w['output_throughput'] / v['output_throughput']:.2f}x vLLM, "
                f"median TTFT {w['median_ttft_ms'] / v['median_ttft_ms']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
