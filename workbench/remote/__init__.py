"""`RemoteEngineClient`: the `EngineClient` surface over any OpenAI-compatible HTTP server.

    eng = workbench.connect("http://127.0.0.1:8000")        # vLLM, SGLang, TGI, llama.cpp, ours
    eng.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
    for chunk in eng.stream("Once upon a time"): ...
    eng.metrics(); eng.timeline(); eng.settings()            # settings are a read-only report
    eng.configure(max_num_seqs=8)                            # RemoteSettingsError

The URL is the server's root (a trailing ``/v1`` is accepted); ``?model=NAME`` picks one of
several served models (default: the first of ``/v1/models``). The API key comes from
``api_key=`` or ``$WORKBENCH_API_KEY`` / ``$OPENAI_API_KEY``. `register_remote("vllm1", url)`
gives a server an engine name, so whatever attaches by name (``workbench.connect("vllm1")``,
the lab panel's server extension) reaches it.

How each part is built:

- requests are streamed (SSE) even for `generate`, so every request's arrival, first token
  and token times are measured here (client side: they include the network);
- `timeline()` holds those per-request events (``arrived``, ``first_token``, ``finished``
  with the finish reason as detail) in the same `Timeline` structs as the engine's; it has no
  steps, since an HTTP server does not report its batches;
- `metrics()` has the engine's keys: gauges and counters from the server's Prometheus
  ``/metrics`` when it has one (vLLM ``vllm:*``, SGLang ``sglang:*``, llama.cpp
  ``llamacpp:*``, TGI ``tgi_*``, ours ``workbench:*``), the latency percentiles from this
  client's requests; a value nobody reports is absent (never made up; same in `status()`),
  and ``sources`` says where each value came from ("server" or "client");
- `settings()` maps what the server tells about itself onto our setting names (ours: all of
  them; vLLM: the KV cache config from /metrics; SGLang: /get_server_info; llama.cpp: /props);
  `configure()` raises `RemoteSettingsError`;
- `events()` delivers "timeline" increments as requests progress and "metrics" once a second.

Token ids and logprobs' token ids are exact with our server and vLLM (``return_token_ids``,
``return_tokens_as_token_ids``); other servers report text only: `token_ids` is then empty,
logprob token ids are -1, and a non-default sampling field that such a server has no
parameter for is dropped with a warning.

All HTTP runs on one asyncio loop in a daemon thread (httpx); callers on any thread or event
loop hand requests to it, as with `EngineClient`'s IO thread.

Modules: `client` (`RemoteEngineClient`), `wire` (the servers' HTTP dialects: URLs, server
kinds, request bodies, logprobs, errors), `prometheus` (parsing `/metrics` onto our metric
names), `registry` (named remotes).
"""

from .client import RemoteEngineClient
from .prometheus import parse_prometheus, server_metrics
from .registry import list_remotes, register_remote, registered_remote, unregister_remote
from .wire import RemoteError, RemoteSettingsError

__all__ = [
    "RemoteEngineClient",
    "RemoteError",
    "RemoteSettingsError",
    "list_remotes",
    "parse_prometheus",
    "register_remote",
    "registered_remote",
    "server_metrics",
    "unregister_remote",
]
