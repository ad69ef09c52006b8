"""The engine server's rule: only its step loop's thread touches the engine (whose state every step
changes), apart from what `LLMEngine.THREAD_SAFE` declares. An in-process server over a proxy that
records the thread of every engine access, driven by a real client over its socket."""

from __future__ import annotations

import threading

import pytest
from jupyter_helpers import private_runtime_dir

from workbench.engine.llm_engine import LLMEngine
from workbench.ipc.client import EngineClient
from workbench.ipc.server import INLINE_TOKENIZE_CHARS, EngineServer
from workbench.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
LOOP = "engine-loop"


class _Recorded:
    """The engine, with the name and calling thread of every attribute the server reads of it."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "seen", [])

    def __getattr__(self, name):
        self.seen.append((name, threading.current_thread().name))
        return getattr(self._engine, name)


def test_only_the_loop_thread_touches_the_engine(tmp_path):
    engine = _Recorded(LLMEngine(None, num_kv_blocks=256))  # the embedded model: text prompts too
    with private_runtime_dir(tmp_path):
        server = EngineServer(engine, name="threads")
        server.start()
        engine.seen.clear()  # from here on the server serves: the rule holds
        loop = threading.Thread(target=server.serve_forever, name=LOOP, daemon=True)
        loop.start()
        client = EngineClient.connect("threads", timeout=30)
        try:
            greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            client.generate(["a short prompt"], greedy, timeout=60)
            client.generate(["word " * (INLINE_TOKENIZE_CHARS // 4)], greedy, timeout=60)  # the tokenizer thread's
            client.generate(prompt_token_ids=[[1, 5, 6, 7]], params=greedy, timeout=60)
            for _ in client.stream(prompt_token_ids=[1, 9, 9], params=greedy, timeout=60):
                pass
            client.configure(max_num_seqs=4)
            client.status(), client.metrics(), client.timeline(since=0)
            assert client.weights_checksum() == engine._engine.weights_checksum()  # the calls thread's
        finally:
            client.call("shutdown")
            loop.join(60)
            client.close()
    assert not loop.is_alive()
    off_loop = sorted({(name, thread) for name, thread in engine.seen if thread != LOOP})
    assert {name for name, _ in off_loop} <= LLMEngine.THREAD_SAFE, off_loop
    # the proxy sees the engine touched from other threads, where the server does that (declared);
    # the tokenizer thread processed the long prompt through `inputs`, read on the loop (issue 48.2)
    assert {name for name, _ in off_loop} == {"weights_checksum"}, off_loop
    assert {"core_step", "core_add", "inputs"} <= {name for name, thread in engine.seen if thread == LOOP}
