"""Our server against vLLM's CPU build, interleaved: both servers up at once (idle, each uses no
CPU), every workload run on one then the other, in alternating order, for several rounds. This
host's speed moves by a third within minutes (docs/benchmarks.md), so only ratios taken within a
round, and their median over rounds, compare the two. Every workload of every round draws its own
prompts (a seed per round and workload), so no server's prefix cache holds a prompt it is about to
be timed on: vLLM's 4 GB cache kept all 64 of the W64 run's prompts, and when the Poisson run
reused them (as it did before 2026-12-03) vLLM's TTFT tail measured its cache, not its prefill.
`poisson_repeat` measures that on purpose: the W64 prompts of the same round again, at 1
request/s (give both servers the same KV memory for it: `--setting kv_cache_memory_mb=4096`).
Runs are 2 s apart (a server's threads spin a while after its run, slowing whatever runs next).

    python docs/probes/vs_vllm.py [--rounds 3] [--workloads w64,poisson,vllm2,vllminf] [--setting K=V]
                                  [--vllm-python PATH] [--vllm-dtype float32] [--json OUT]

w64: the bench's 64 requests at once (`workbench bench` workload, text prompts, our client);
poisson: 64 others like them at 1 request/s; poisson_repeat: w64's own at 1 request/s;
vllm2 / vllminf: vLLM's own client (`vllm bench serve`, random 256 in / 128 out, 64 prompts) at 2
requests/s and all at once (each its own prompts). Each line: both servers'
figures and ours / vLLM's; the last lines: the medians over rounds.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time

from workbench.bench.driver import serve_workload
from workbench.bench.endpoint import endpoint_summary, load_tokenizer
from workbench.bench.server_peer import RunningPeer
from workbench.bench.vllm_peer import (
    find_vllm_python,
    run_vllm_client,
    vllm_dtype,
    vllm_server,
    vllm_version,
    workbench_http_server,
)
from workbench.bench.workload import make_workload
from workbench.models.embedded import ensure_converted
from workbench.models.loader import DEFAULT_MODEL, default_gguf_path
from workbench.remote import RemoteEngineClient
from workbench.runs import machine_facts
from workbench.sampling_params import SamplingParams

OUR_PATHS = ("kernel_variant", "compute_path", "compute_path_reason", "prefill_attention", "prefill_attention_reason")
KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
CLIENT_KEYS = {
    "output_tok_s": "output_throughput",
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "itl_p50_ms": "median_itl_ms",
    "itl_p99_ms": "p99_itl_ms",
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="w64,poisson,vllm2,vllminf")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--setting", action="append", default=[], metavar="K=V", help="a setting of our server")
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's --dtype (default: the bench's choice for this CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    python = find_vllm_python(args.vllm_python)
    if python is None:
        print("no Python with vLLM: run `make peers` or pass --vllm-python", file=sys.stderr)
        return 2
    hf_dir = str(ensure_converted(default_gguf_path(), DEFAULT_MODEL))
    tok = load_tokenizer()

    def ours_workload(arrival, rate, seed):
        wl = make_workload(64, seed=seed, tokenizer=tok, arrival=arrival, rate=rate)
        return [
            dataclasses.replace(r, prompt=tok.decode(r.prompt_token_ids, skip_special_tokens=True)) for r in wl.requests
        ]

    # a new seed each round: the prompts of earlier rounds sit in the prefix caches (vLLM's 4 GB keeps them all)
    fresh = 1000  # a seed offset: another workload's prompts
    workloads = {
        "w64": lambda seed: ours_workload("all", None, seed),
        "poisson": lambda seed: ours_workload("poisson", 1.0, seed + fresh),
        "poisson_repeat": lambda seed: ours_workload("poisson", 1.0, seed),
    }
    settings = dict(kv.split("=", 1) for kv in args.setting)
    vllm_dt = args.vllm_dtype or vllm_dtype()[0]
    out = {
        "machine": machine_facts()["cpu"],
        "vllm": vllm_version(python),
        "vllm_dtype": vllm_dt,
        "settings": settings,
        "rounds": [],
    }
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    ours = workbench_http_server(None, settings, name=f"vs-vllm-{int(time.time())}")
    theirs = vllm_server(
        python, hf_dir, name=DEFAULT_MODEL, max_num_seqs=64, max_model_len=2048, threads=2, dtype=vllm_dt
    )
    with RunningPeer(ours, say) as a, RunningPeer(theirs, say) as b:
        servers = {"workbench": a.peer, "vllm": b.peer}
        with RemoteEngineClient(a.peer.url) as c:  # which paths our server measured and took, and why
            engine = c.status().get("remote_engine", {})
        out["ours"] = {k: engine.get(k) for k in OUR_PATHS}
        say("ours: " + "; ".join(f"{k} {v}" for k, v in out["ours"].items()))
        names = {"workbench": _model_name(a.peer.url), "vllm": DEFAULT_MODEL}
        for rnd in range(args.rounds):
            order = ["workbench", "vllm"] if rnd % 2 == 0 else ["vllm", "workbench"]
            for wname in args.workloads.split(","):
                row = {"round": rnd, "workload": wname}
                for server in order:
                    url = servers[server].url
                    time.sleep(2.0)  # the other server's threads may spin-wait a while after its run
                    if wname.startswith("vllm"):
                        r = run_vllm_client(
                            python,
                            url,
                            model=names[server],
                            tokenizer=hf_dir,
                            num_prompts=64,
                            request_rate=None if wname == "vllminf" else 2.0,
                            seed=rnd if wname == "vllm2" else rnd + fresh,
                        )
                        row[server] = {k: r[v] for k, v in CLIENT_KEYS.items()}
                    else:
                        with RemoteEngineClient(url) as c:
                            c.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))
                            served, start = serve_workload(c, workloads[wname](rnd), keep_errors=True)
                        s = endpoint_summary(served, start)
                        row[server] = {k: s[k] for k in KEYS} | {"errors": s["errors"]}
                row["ratio"] = {k: row["workbench"][k] / row["vllm"][k] for k in KEYS if row["vllm"][k]}
                out["rounds"].append(row)
                w, v, r = row["workbench"], row["vllm"], row["ratio"]
                print(
                    f"round {rnd} {wname:8s} ours {w['output_tok_s']:6.1f} tok/s TTFT {w['ttft_p50_ms']:6.0f}/"
                    f"{w['ttft_p99_ms']:6.0f} ITL {w['itl_p50_ms']:5.1f}/{w['itl_p99_ms']:6.1f} | vLLM "
                    f"{v['output_tok_s']:6.1f} TTFT {v['ttft_p50_ms']:6.0f}/{v['ttft_p99_ms']:6.0f} ITL "
                    f"{v['itl_p50_ms']:5.1f}/{v['itl_p99_ms']:6.1f} | ratio tok/s {r['output_tok_s']:.2f} "
                    f"TTFT {r['ttft_p50_ms']:.2f}/{r['ttft_p99_ms']:.2f} ITL {r['itl_p50_ms']:.2f}/"
                    f"{r['itl_p99_ms']:.2f}",
                    flush=True,
                )
    out["median_ratio"] = {}
    for wname in args.workloads.split(","):
        rows = [r for r in out["rounds"] if r["workload"] == wname]
        med = {k: statistics.median(r["ratio"][k] for r in rows) for k in rows[0]["ratio"]}
        out["median_ratio"][wname] = med
        print(f"median over {len(rows)} rounds, {wname}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
