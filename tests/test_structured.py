"""Structured output (issue 47): JSON schemas, json_object, regexes, EBNF grammars and choices
constrain decoding through XGrammar, for greedy and sampled requests, beside jump-forward,
speculative decoding and prefix caching; bad constraints are refused before anything runs; a
large grammar compiles off an engine process's step loop."""

import json
import re
import threading
import time

import jsonschema
import pytest

from workbench import LLM, SamplingParams
from workbench.ipc.launch import start_engine
from workbench.sampling_params import StructuredOutput

pytestmark = pytest.mark.timeout(600)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
}
GRAMMAR = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+ | [0-9]+'
GRAMMAR_RE = r"\[([a-z]+|[0-9]+)(,([a-z]+|[0-9]+))*\]"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
PROMPTS = [
    "Write a person record as JSON:",
    "Give me a list:",
    "Here is the phone number of the office:",
    "The sentiment of the review 'I loved it' is",
    "Once upon a time",
    "{",
]
KINDS = {
    "json": ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
    "json_object": ({"json_object": True}, lambda t: _is_object(json.loads(t))),
    "regex": ({"regex": PHONE}, lambda t: _match(PHONE, t)),
    "grammar": ({"grammar": GRAMMAR}, lambda t: _match(GRAMMAR_RE, t)),
    "choice": ({"choice": CHOICES}, lambda t: _match("|".join(CHOICES), t)),
}


def _is_object(value) -> None:
    assert isinstance(value, dict), value


def _match(pattern: str, text: str) -> None:
    assert re.fullmatch(pattern, text), (pattern, text)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=256)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_finished_output_matches_its_constraint(llm, kind):
    spec, check = KINDS[kind]
    params = [SamplingParams(max_tokens=48, temperature=0, structured=spec)]
    params += [SamplingParams(max_tokens=48, temperature=t, top_p=p, top_k=k, min_p=m, seed=s, structured=spec)
               for s, (t, p, k, m) in enumerate([(0.7, 1.0, -1, 0.0), (1.0, 0.9, -1, 0.0), (1.2, 1.0, 20, 0.0),
                                                 (0.9, 1.0, -1, 0.1)])]  # fmt: skip
    outs = llm.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS))
    complete = 0
    for out in outs:
        assert out.structured_complete is (out.finish_reason == "stop"), (out.text, out.finish_reason)
        if out.structured_complete:
            check(out.text)
            complete += 1
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 48
    assert complete >= len(outs) // 2  # a few sampled strings may run to max_tokens


@pytest.mark.parametrize("kind", list(KINDS))
def test_jump_forward_keeps_greedy_outputs_token_for_token(llm, kind):
    spec, check = KINDS[kind]
    params = SamplingParams(max_tokens=40, temperature=0, structured=spec)
    llm.configure(jump_forward=False)
    before = llm.metrics()["total_jump_forward_tokens"]
    plain = llm.generate(PROMPTS, params)
    assert llm.metrics()["total_jump_forward_tokens"] == before
    llm.configure(jump_forward=True)
    jumped = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in jumped] == [o.token_ids for o in plain]
    for o in jumped:
        if o.structured_complete:
            check(o.text)
    if kind in ("json", "choice"):  # their grammars force text ('"age": ', the rest of a choice)
        assert llm.metrics()["total_jump_forward_tokens"] > before


def test_jump_forward_steps_are_counted_on_the_timeline(llm):
    llm.configure(jump_forward=True)
    since = llm.engine.timeline.next_seq()
    [out] = llm.generate("Write a person record as JSON:", SamplingParams(max_tokens=40, temperature=0,
                                                                         structured={"json": PERSON}))  # fmt: skip
    steps = [s for s in llm.engine.timeline.read(since).steps if any(b.request_id == out.request_id for b in s.batch)]
    saved = sum(s.jump_forward_tokens for s in steps)
    assert saved > 0
    # every output token but the first came from a step: one per step, plus the forced ones kept
    assert len(steps) == len(out.token_ids) - saved
    assert any("mask" in s.parts for s in steps)


def _states(llm, spec, prefixes):
    """GrammarStates of `spec` after each of `prefixes` (texts the grammar takes)."""
    from workbench.engine import structured

    compiled = llm.engine.grammars.get(StructuredOutput(**spec))
    states = []
    for text in prefixes:
        state = structured.GrammarState(compiled, llm.engine.tokenizer)
        state.matcher.accept_string(text)
        states.append(state)
    return states


def test_greedy_rows_are_masked_only_where_their_argmax_breaks_the_grammar(llm):
    """The shortcut for greedy rows (check the argmax, mask only if the grammar refuses it) picks
    what masking every row first picks, on random logits at many grammar states, and a greedy
    verify window accepts what the fully masked window accepts."""
    import torch

    from workbench.engine import sampler, speculative, structured
    from workbench.engine.sequence import Sequence

    prefixes = ["", '{"', '{"name": "Al', '{"name": "Al", "age": 4', '{"name": "Al", "age": 40, "city": "']
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    for trial in range(20):
        states = _states(llm, {"json": PERSON}, prefixes)
        seqs = []
        for st in states:
            seq = Sequence("r", [1], SamplingParams(temperature=0), 0.0)
            seq.grammar = st
            seqs.append(seq)
        logits = torch.randn(len(seqs), vocab, generator=gen) * 3
        if trial % 2:  # the model's favourite is what the grammar wants at some rows
            for row, st in enumerate(states):
                if row % 2 == 0 and st.forced_tokens(1):
                    logits[row, st.forced_tokens(1)[0]] += 50
        full = logits.clone()
        structured.apply_masks(full, dict(enumerate(states)))
        expected = full.max(-1).indices.tolist()
        got = structured.sample(logits.clone(), seqs, lambda rows, s: sampler.sample(rows, s))
        assert got == expected
        for st in states:
            draft = st.forced_tokens(4)
            if not draft:
                continue
            window = torch.randn(len(draft) + 1, vocab, generator=gen)
            for i, tok in enumerate(draft[: trial % (len(draft) + 1)]):
                window[i, tok] += 50  # the model agrees with the first few drafts
            seq = Sequence("r", [1], SamplingParams(temperature=0), 0.0)
            assert st.greedy_accept(window, draft) == speculative.accept(
                seq, st.mask_window(window, draft), draft, None
            )


def test_a_grammar_admitting_any_text_changes_no_greedy_output(llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for spec in ({"regex": r"[\s\S]*"}, {"grammar": "root ::= [^]*"}):
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, structured=spec))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_drafts_are_verified_under_the_grammar(llm, speculative):
    spec = {"json": PERSON}
    greedy = SamplingParams(max_tokens=40, temperature=0, structured=spec)
    plain = llm.generate(PROMPTS, greedy)
    llm.configure(speculative=speculative, num_speculative_tokens=4)
    try:
        with_drafts = llm.generate(PROMPTS, greedy)
        sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured=spec))
    finally:
        llm.configure(speculative="off")
    assert [o.token_ids for o in with_drafts] == [o.token_ids for o in plain]
    for o in sampled:
        assert o.structured_complete is (o.finish_reason == "stop")
        if o.structured_complete:
            jsonschema.validate(json.loads(o.text), PERSON)


def test_prefix_cache_and_constrained_batches_mixed_with_free_ones(llm):
    free = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.generate(PROMPTS, free)
    llm.reset_prefix_cache()
    constrained = SamplingParams(max_tokens=40, temperature=0, structured={"json": PERSON})
    first = llm.generate(PROMPTS, constrained)
    mixed = llm.generate(PROMPTS * 2, [constrained] * len(PROMPTS) + [free] * len(PROMPTS))
    assert [o.token_ids for o in mixed[: len(PROMPTS)]] == [o.token_ids for o in first]
    assert [o.token_ids for o in mixed[len(PROMPTS) :]] == [o.token_ids for o in alone]
    assert all(o.metrics.prefix_hit_tokens > 0 for o in mixed if len(o.prompt_token_ids) > 16)


def test_a_grammar_cut_by_max_tokens_ends_with_length_and_says_so(llm):
    since = llm.engine.timeline.next_seq()
    [out] = llm.generate("Person:", SamplingParams(max_tokens=5, temperature=0, structured={"json": PERSON}))
    assert out.finish_reason == "length" and out.structured_complete is False
    with pytest.raises(ValueError):
        json.loads(out.text)
    [ev] = [e for e in llm.engine.timeline.read(since).requests if e.kind == "finished"]
    assert "grammar was complete" in ev.detail


def test_grammars_compile_once_and_the_timeline_says_so(llm):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    before = llm.metrics()["total_grammar_compiles"]
    since = llm.engine.timeline.next_seq()
    for _ in range(2):
        llm.generate("x:", SamplingParams(max_tokens=12, temperature=0, structured={"json": schema}))
    assert llm.metrics()["total_grammar_compiles"] == before + 1
    details = [e.detail for e in llm.engine.timeline.read(since).requests if e.kind == "grammar"]
    assert details[0].startswith("json compiled in") and details[1].startswith("json cached")


@pytest.mark.parametrize(
    "spec, says",
    [
        ({"json": {"type": "bogus"}}, "structured.json is invalid: Unsupported type"),
        ({"json": '{"type": '}, "structured.json is not valid JSON"),
        ({"regex": "(ab"}, "structured.regex is invalid: Regex parsing error"),
        (
            {"grammar": "root ::= missing"},
            'structured.grammar is invalid: EBNF parser error at line 1, column 10: Rule "missing"',
        ),
        (
            {"regex": "a", "choice": ["b"]},
            "exactly one of json, json_object, regex, grammar, choice, structural_tag; got regex, choice",
        ),
        ({}, "exactly one of"),
        ({"choice": []}, "non-empty list of str"),
        ({"schema": {}}, "unknown SamplingParams.structured field(s) ['schema']"),
    ],
)
def test_bad_constraints_are_refused_and_the_engine_serves_on(llm, spec, says):
    with pytest.raises((ValueError, TypeError)) as err:
        llm.generate("x", SamplingParams(max_tokens=4, structured=spec))
    assert says in str(err.value)
    since = llm.engine.timeline.next_seq()
    good = SamplingParams(max_tokens=4, temperature=0, structured={"choice": ["ok"]})
    with pytest.raises((ValueError, TypeError)):  # one bad constraint in a batch: nothing of it runs
        llm.generate(["a", "b"], [good, SamplingParams(max_tokens=4, structured=spec)])
    assert not llm.engine.timeline.read(since).requests and not llm.engine.has_unfinished_requests()
    [out] = llm.generate("x", good)
    assert out.text == "ok"


@pytest.mark.parametrize("other", [{"ignore_eos": True}, {"min_tokens": 2}])
def test_what_would_overrule_the_grammars_end_is_refused(other):
    with pytest.raises(ValueError, match="grammar decides where the output ends"):
        SamplingParams(structured={"regex": "a+"}, **other)


def test_structured_output_travels_on_the_wire():
    import msgspec

    sp = SamplingParams(structured={"json": PERSON})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert back.structured == StructuredOutput(json=PERSON)
    with pytest.raises(msgspec.ValidationError, match="exactly one of"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"structured": {}}), type=SamplingParams)


# A schema that takes XGrammar a second or more to compile (200 patterned string fields).
SLOW_SCHEMA = {
    "type": "object",
    "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{2,8}-[0-9]{1,4}"} for i in range(200)},
    "required": ["f0"],
}


def test_a_slow_grammar_compiles_off_the_step_loop():
    """While an engine process compiles a large schema on its tokenizer thread, the stream beside
    it keeps getting tokens (its steps run inside the compile's window), and an invalid schema
    submitted then is refused while that stream still runs."""
    eng = start_engine(name="wb-test-structured", dtype="float32", num_kv_blocks=128, timeout=120)
    try:
        stream = eng.stream("Count to a thousand:", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        next(stream)
        since = eng.timeline().steps[-1].seq
        done = {}

        def slow():
            done["out"] = eng.generate("Fill the form:", SamplingParams(max_tokens=8, structured={"json": SLOW_SCHEMA}))

        worker = threading.Thread(target=slow)
        submitted = time.monotonic()
        worker.start()
        with pytest.raises(ValueError, match="structured.regex is invalid"):
            eng.generate("x", SamplingParams(max_tokens=4, structured={"regex": "(("}))
        worker.join(120)
        [out] = done["out"]
        tl = eng.timeline()
        [arrived] = [e for e in tl.requests if e.request_id == out.request_id and e.kind == "arrived"]
        [compiled] = [e for e in tl.requests if e.request_id == out.request_id and e.kind == "grammar"]
        ms = float(re.search(r"compiled in ([\d.]+) ms", compiled.detail).group(1))
        assert ms > 200, compiled.detail  # the compile really was long
        during = [s for s in tl.steps if s.seq > since and submitted < s.end < arrived.time]
        assert len(during) >= 3, (len(during), ms)
        rest = list(stream)
        assert rest[-1].finish_reason == "length"
    finally:
        eng.shutdown()
