"""The output processor (`workbench.processing.output`): the engine core's token ids to text, stop
strings found where the output is consumed. In-process it runs in `LLMEngine.step`; for an engine
process it runs in the client, and a stop string it finds ends the request in the engine (which
may have run one step past it: those tokens are dropped)."""

from __future__ import annotations

import threading

import pytest
from jupyter_helpers import private_runtime_dir

from workbench.engine.llm_engine import LLMEngine
from workbench.http.server import load_front_tokenizer
from workbench.ipc import pending
from workbench.ipc.client import EngineClient
from workbench.ipc.protocol import Stop
from workbench.ipc.server import EngineServer
from workbench.outputs import CoreFinal, CoreOutput, RequestMetrics
from workbench.processing.output import OutputProcessor
from workbench.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tokenizer():
    return load_front_tokenizer("default")  # the embedded SmolLM2's


def _final(rid: str, ids: list[int], reason: str) -> CoreOutput:
    final = CoreFinal(metrics=RequestMetrics(), prompt_token_ids=[1, 2], token_ids=ids)
    return CoreOutput(rid, [], reason, final=final)


def test_a_stop_string_is_held_back_asked_of_the_core_and_ends_with_its_final(tokenizer):
    words = [tokenizer.encode(w) for w in ["Hello", " there", ",", " my", " friend", " again"]]
    proc = OutputProcessor(tokenizer)
    proc.add("r", "a prompt", SamplingParams(max_tokens=50, stop=[", my fr"]))
    streamed = ""
    ids: list[int] = []
    for w in words[:4]:  # "Hello there, my": the stop string could still be completing
        ids += w
        chunks, stops = proc.process([CoreOutput("r", w)])
        assert stops == []
        streamed += "".join(c.text_delta for c in chunks)
    assert streamed == "Hello the"  # the last len(stop) - 1 characters wait: a stop string may be completing
    ids += words[4]
    chunks, stops = proc.process([CoreOutput("r", words[4])])
    assert chunks == [] and stops == [("r", len(ids))]  # the core is told how many tokens stay
    # the core ran one more step before the stop arrived: its tokens are not output
    assert proc.process([CoreOutput("r", words[5])]) == ([], [])
    [last], stops = proc.process([_final("r", ids, "stop")])
    assert stops == [] and last.finish_reason == "stop"
    assert last.token_ids_delta == words[4]  # the stop's own step, sent with the final chunk
    assert streamed + last.text_delta == "Hello there" == last.output.text
    assert last.output.token_ids == ids and last.output.prompt == "a prompt"
    assert proc.requests == {}


def test_min_tokens_and_a_core_finish_in_the_same_step(tokenizer):
    hello = tokenizer.encode("Hello")
    proc = OutputProcessor(tokenizer)
    proc.add("early", None, SamplingParams(max_tokens=50, stop=["Hello"], min_tokens=2))
    chunks, stops = proc.process([CoreOutput("early", hello)])
    assert stops == [] and chunks[0].text_delta == "H"  # 1 token < min_tokens: no stop; 4 characters held back
    # the core ends a request (max_tokens) in the step whose text holds a stop string: it says "stop"
    proc.add("both", None, SamplingParams(max_tokens=2, stop=["lo"]))
    out = CoreOutput("both", hello, "length", final=CoreFinal(RequestMetrics(), [1], hello))
    [last], stops = proc.process([out])
    assert stops == [] and last.finish_reason == "stop" and last.output.text == "Hel"
    # outputs of a request it was not told of (another client's, or dropped) are skipped
    assert proc.process([CoreOutput("unknown", hello)]) == ([], [])


def test_a_final_output_alone_carries_the_whole_answer(tokenizer):
    """An engine process sends a request that neither streams nor has stop strings or logprobs
    only its last output: the text comes from the final's ids."""
    ids = tokenizer.encode("Paris is the capital of France.")
    proc = OutputProcessor(tokenizer)
    proc.add("quiet", "p", SamplingParams(max_tokens=len(ids)))
    [last], _ = proc.process([CoreOutput("quiet", ids[-1:], "length", final=CoreFinal(RequestMetrics(), [1], ids))])
    assert last.output.text == "Paris is the capital of France." and last.output.token_ids == ids


def test_without_a_tokenizer_outputs_are_ids():
    proc = OutputProcessor(None)
    proc.add("r", None, SamplingParams(max_tokens=3, stop=["x"]))
    chunks, _ = proc.process([CoreOutput("r", [5, 6])])
    [last], _ = proc.process([_final("r", [5, 6, 7], "length")])
    assert [c.token_ids_delta for c in chunks] == [[5, 6]] and last.output.text == ""
    assert last.output.token_ids == [5, 6, 7]


def test_stop_strings_end_requests_alike_in_process_and_over_the_socket(tmp_path):
    """Greedy, the embedded model in float32 (a request alone and in a batch agree): a stop string
    ends a request with the same text and token ids whether the engine's own `step` found it or the
    client of an engine process did (which drops the step the engine ran past it); the engine
    process's timeline says why, its token count holds no dropped token, and its loop never read
    text."""
    prompts = ["The capital of France is", "Write a list of three colours:", "Once upon a time"]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    local = LLMEngine(None, dtype="float32", num_kv_blocks=256)
    plain = _run(local, prompts, greedy)
    stops = []
    for out in plain:  # a stop string out of each answer's middle, where it first occurs
        text = out.text
        k = next(i for i in range(len(text) // 3, len(text) - 4) if text.find(text[i : i + 4]) == i)
        stops.append(text[k : k + 4])
    with_stop = [SamplingParams(max_tokens=40, temperature=0, stop=[s]) for s in stops]
    expected = _run(local, prompts, with_stop)
    for out, s, p in zip(expected, stops, plain):
        assert out.finish_reason == "stop" and s not in out.text and p.text.startswith(out.text + s)

    pending._tokenizers.clear()  # as in a fresh process (an earlier test's client may have fetched it)
    served = _Served(LLMEngine(None, dtype="float32", num_kv_blocks=256), tmp_path)
    try:
        client = served.client
        client.status()
        assert served.shipped == 0  # a client that only watches never fetches the tokenizer
        got = client.generate(prompts, with_stop, timeout=120)
        with EngineClient.connect("outputs", timeout=30) as other:  # this process has it now
            assert other.generate(prompts[:1], with_stop[:1], timeout=60)[0].text == expected[0].text
            assert other.tokenizer is client.tokenizer and served.shipped == 1
            # a Stop for another client's request is not taken: only its own client reads its text
            told, long = [], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            for chunk in client.stream(prompts[0], long, timeout=120):
                if not told:
                    told.append(other._post(Stop(chunk.request_id, 0)))
            assert chunk.finish_reason == "length" and len(chunk.output.token_ids) == long.max_tokens
        streamed = [
            "".join(c.text_delta for c in client.stream(p, sp, timeout=120)) for p, sp in zip(prompts, with_stop)
        ]
        timeline = client.timeline(since=0)
        metrics = client.metrics()
    finally:
        served.close()
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [
        (o.text, o.token_ids, o.finish_reason) for o in expected
    ]
    assert streamed == [o.text for o in expected]  # no delta ever showed a stop string
    finished = [e.detail for e in timeline.requests if e.kind == "finished"]
    assert sorted(finished) == ["length"] + ["stop"] * 7
    stopped = 2 * sum(len(o.token_ids) for o in expected) + len(expected[0].token_ids)
    assert metrics["total_output_tokens"] == stopped + 40
    touched = {name for name, _ in served.seen}
    assert {"core_step", "core_stop"} <= touched
    assert not touched & {"step", "add_processed", "abort_request", "outputs"}, touched  # text is the client's


def _run(engine: LLMEngine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for c in engine.step():
            if c.output is not None:
                done[c.request_id] = c.output
    return [done[r] for r in rids]


class _Served:
    """An engine process's server over `engine`, in this process on a thread of its own, with a
    client; `seen` is every engine attribute the server read."""

    def __init__(self, engine: LLMEngine, tmp_path):
        seen = self.seen = []

        class Recorded:
            def __getattr__(self, name):
                seen.append((name, threading.current_thread().name))
                return getattr(engine, name)

        self._dir = private_runtime_dir(tmp_path)
        self._dir.__enter__()
        self.server = EngineServer(Recorded(), name="outputs")
        self.shipped = 0  # times a client asked for the tokenizer
        ship = self.server._methods["tokenizer"]

        def counted(who):
            self.shipped += 1
            return ship(who)

        self.server._methods["tokenizer"] = counted
        self.server.start()
        self._loop = threading.Thread(target=self.server.serve_forever, name="engine-loop", daemon=True)
        self._loop.start()
        self.client = EngineClient.connect("outputs", timeout=30)

    def close(self) -> None:
        try:
            self.client.call("shutdown")
            self._loop.join(60)
        finally:
            self.client.close()
            self._dir.__exit__(None, None, None)
