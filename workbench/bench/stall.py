"""The `stall` scenario (`scenarios.py` runs it): two streams decode on an engine process, one
through the Python client and one through an HTTP front attached to it, while other clients
send text and token ids far too long for the context, and text just under the length bound.
Reported per attack: each stream's worst gap between tokens against its median gap."""

from __future__ import annotations

import sys
import time

from .stats import percentile

STALL_WORST_GAP_VS_ITL = 6.0  # the target: a stream's worst gap at most this many of its median gaps


def stall_scenario(model=None, *, oversized: int = 30, near_bound: int = 3, output_len: int = 800, **settings) -> dict:
    """The `stall` scenario on its own engine process and an HTTP front attached to it (both
    started and stopped here): a stream through each, while the attacks of `STALL_ATTACKS` run one
    after another."""
    import json
    import threading

    import httpx

    from ..ipc.client import EngineClient
    from ..ipc.launch import start_engine
    from ..sampling_params import SamplingParams

    eng = start_engine(model, **settings)
    front = None
    try:
        status = eng.status()
        engine = {"model": status["model"], "settings": eng.settings(), "status": described(status)}
        context, most = status["max_model_len"], status.get("max_token_chars")
        front, url = _attached_front(eng.name, model)
        tokens = min(output_len, context - 8)
        times: dict[str, list[float]] = {"python_stream": [], "http_stream": []}
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        body = {
            "prompt": [1, 2, 3, 4],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        streams = [
            threading.Thread(
                target=lambda: times["python_stream"].extend(
                    time.monotonic() for _ in eng.stream(prompt_token_ids=[1, 2, 3, 4], params=params, timeout=600)
                )
            ),
            threading.Thread(target=_sse_times, args=(url, body, times["http_stream"])),
        ]
        for t in streams:
            t.start()
        while min(len(v) for v in times.values()) < 20 and all(t.is_alive() for t in streams):
            time.sleep(0.01)
        huge = "word " * ((8 << 20) // 5)  # 8 MiB: refused from its length
        near = "word " * (int(0.95 * (most or 16) * context) // 5)  # tokenized, then refused
        # HTTP bodies encoded once, here: encoding 8 MiB per request would hold this process's GIL
        # and delay the threads that time the streams
        huge_body = json.dumps({"prompt": huge, "max_tokens": 1}).encode()
        ids = b'{"max_tokens": 1, "prompt": [' + b"5," * (((15 << 20) - 64) // 2) + b"5]}"  # 15 MiB of ids
        windows, errors = {}, {}
        with EngineClient.connect(eng.name, timeout=30) as other, httpx.Client(timeout=600) as http:
            attacks = {
                "python_text": (oversized, lambda: other.generate(huge, SamplingParams(max_tokens=1), timeout=600)),
                "http_text": (
                    oversized,
                    lambda: _refused(
                        http.post(
                            url + "/v1/completions", content=huge_body, headers={"content-type": "application/json"}
                        )
                    ),
                ),
                "http_token_ids": (
                    oversized,
                    lambda: _refused(
                        http.post(url + "/v1/completions", content=ids, headers={"content-type": "application/json"})
                    ),
                ),
                "near_bound": (near_bound, lambda: other.generate(near, SamplingParams(max_tokens=1), timeout=600)),
            }
            for name, (count, send) in attacks.items():
                refusals, seen = [], set()
                start = time.monotonic()
                for _ in range(count):
                    t0 = time.monotonic()
                    try:
                        send()
                        seen.add("accepted")
                    except ValueError as e:
                        seen.add(str(e).split(";")[0][:80])
                    refusals.append(time.monotonic() - t0)
                windows[name] = (start, time.monotonic(), refusals)
                errors[name] = sorted(seen)
        for t in streams:
            t.join(600)
    finally:
        if front is not None:
            front.terminate()
            front.wait(30)
        eng.shutdown()
    itl = {k: percentile([b - a for a, b in zip(v, v[1:])], 50) for k, v in times.items()}
    attacks_out, worst_ratio = {}, 0.0
    for name, (start, end, refusals) in windows.items():
        worst = {
            k: max((b - a for a, b in zip(v, v[1:]) if b >= start and a <= end), default=0.0) for k, v in times.items()
        }
        ratio = max((worst[k] / itl[k] for k in worst if itl[k]), default=0.0)
        worst_ratio = max(worst_ratio, ratio)
        attacks_out[name] = {
            "prompts": len(refusals),
            "errors": errors[name],
            "refusal_ms": {"p50": percentile(refusals, 50) * 1e3, "max": max(refusals) * 1e3},
            "worst_gap_ms": {k: v * 1e3 for k, v in worst.items()},
            "worst_gap_vs_itl": ratio,
        }
    return {
        "engine": engine,
        "workload": {
            "stream_tokens": {k: len(v) for k, v in times.items()},
            "context": context,
            "oversized_prompts": oversized,
            "oversized_chars": len(huge),
            "token_id_body_bytes": len(ids),
            "near_bound_prompts": near_bound,
            "near_bound_chars": len(near),
        },
        "itl_p50_ms": {k: v * 1e3 for k, v in itl.items()},
        "attacks": attacks_out,
        "worst_gap_vs_itl": worst_ratio,
        "target_at_most": STALL_WORST_GAP_VS_ITL,
    }


def _attached_front(name: str, model) -> tuple:
    """`python -m workbench.http --attach NAME` on a free loopback port, as users run one: its
    own process, so its event loop and the measuring threads here do not share a GIL."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "workbench.http",
        "--attach",
        name,
        "--http",
        f"127.0.0.1:{port}",
        "--http-log-level",
        "warning",
    ] + ([] if model is None else ["--model", str(model)])
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the HTTP front for the stall scenario did not start ({' '.join(cmd)})")


def _sse_times(url: str, body: dict, into: list[float]) -> None:
    """The arrival time of every streamed token of one completion."""
    import json

    import httpx

    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                    into.append(time.monotonic())


def _refused(response) -> None:
    """An HTTP answer as the Python client's outcome: a 4xx is the ValueError it would raise."""
    if response.status_code >= 400:
        raise ValueError(response.json()["error"]["message"])


def described(status: dict) -> dict:
    """An engine's status as a report keeps it (without what changes from run to run)."""
    return {k: v for k, v in status.items() if k not in ("pid", "uptime_s")}
