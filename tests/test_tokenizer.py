"""Tokenizer wrapper, chat templates and the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from workbench.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_tokenizer() -> HFTokenizer:
    """A tiny byte-level BPE: 3 specials, the 256 byte symbols, a few merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe", "Ġa", "in"]
    vocab = {t: i for i, t in enumerate(specials + symbols + merged)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n")]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tk


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    _byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.fixture
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir, eos_token_ids=[0])


TEXTS = [
    "the cat sat on the mat.",
    "héllo wörld — naïve café",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "中文 日本語のテキスト 한국어",
    "mixed: a😀b中c\n\ttabs  and  spaces ",
]


# ----------------------------------------------------------------------------- basics
def test_basics(tiny):
    assert tiny.vocab_size == 3 + 256 + 5
    assert tiny.bos_token_id == 1 and tiny.eos_token_ids == [2, 0]
    assert tiny.bos_token == "<|im_start|>" and tiny.eos_token == "<|im_end|>"
    assert tiny.id_to_token(2) == "<|im_end|>" and tiny.token_to_id("Ġthe") is not None
    ids = tiny.encode(" the<|im_end|>")
    assert [tiny.id_to_token(i) for i in ids] == ["Ġthe", "<|im_end|>"]
    assert tiny.decode(ids) == " the"
    assert tiny.decode(ids, skip_special_tokens=False) == " the<|im_end|>"
    for t in TEXTS:
        assert tiny.decode(tiny.encode(t)) == t


def test_chat_template(tiny, tiny_dir):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tiny.apply_chat_template("Hi", add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"

    # bos/eos are passed to the template; raise_exception raises
    tpl = "{{ bos_token }}{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    tpl += "{{ messages[0]['content'] }}{{ eos_token }}"
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tpl
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    t2 = Tokenizer.from_dir(tiny_dir)
    assert t2.apply_chat_template("x") == "<|im_start|>x<|im_end|>"
    with pytest.raises(ChatTemplateError, match="user first"):
        t2.apply_chat_template([{"role": "assistant", "content": "x"}])

    # transformers 5 keeps the template in chat_template.jinja
    del cfg["chat_template"]
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tiny_dir / "chat_template.jinja").write_text(CHATML)
    assert Tokenizer.from_dir(tiny_dir).apply_chat_template("Hi") == tiny.apply_chat_template("Hi")

    (tiny_dir / "chat_template.jinja").unlink()
    bare = Tokenizer.from_dir(tiny_dir)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template("Hi")


def test_template_is_sandboxed(tiny_dir):
    cfg = {"chat_template": "{{ messages.__class__.__mro__ }}"}
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        Tokenizer.from_dir(tiny_dir).apply_chat_template("x")


# ----------------------------------------------------------------------------- incremental
def _stream(tok: Tokenizer, ids: list[int], prompt_ids=None, step: int = 1) -> list[str]:
    det = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas = [det.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(det.flush())
    assert det.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_matches_full_decode(tiny, text, step):
    ids = tiny.encode(text)
    deltas = _stream(tiny, ids, step=step)
    assert "".join(deltas) == tiny.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_partial_characters(tiny):
    ids = tiny.encode("a😀")
    assert len(ids) == 5  # "a" + four byte tokens
    det = IncrementalDetokenizer(tiny)
    assert det.add(ids[0]) == "a"
    assert [det.add(i) for i in ids[1:4]] == ["", "", ""]
    assert det.add(ids[4]) == "😀"
    # a sequence that ends in the middle of a character: flush gives what decode gives
    det = IncrementalDetokenizer(tiny)
    assert det.add(ids[:1]) == "a" and det.add(ids[1:3]) == ""
    assert det.flush() == tiny.decode(ids[:3])[1:] == "\ufffd"


def test_incremental_with_prompt_and_specials(tiny):
    prompt = tiny.encode("Once upon a time,")
    gen = tiny.encode(" the 😀 end") + [2] + tiny.encode(" more")
    deltas = _stream(tiny, gen, prompt_ids=prompt)
    assert "".join(deltas) == tiny.decode(gen) == " the 😀 end more"
    assert deltas[0] == " the"  # the leading space survives: the prompt gives context


def test_incremental_window_stays_small(tiny):
    text = "the quick brown fox jumps over the lazy dog 😀 " * 40
    ids = tiny.encode(text)
    det = IncrementalDetokenizer(tiny, prompt_ids=ids[:50])
    longest = 0
    for i in ids:
        det.add(i)
        longest = max(longest, len(det._ids) - det.prefix_offset)
    assert det.text + det.flush() == text
    assert longest <= 8  # the decoded window never grows with the output length


# ----------------------------------------------------------------------------- SmolLM2 (real)
@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    from workbench.models import loader

    folder = loader.ensure_converted(loader.default_gguf_path(), loader.DEFAULT_MODEL)
    return Tokenizer.from_dir(folder)


SMOL_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "Once upon a time, there was a little girl named Emma.\n\n  def f(x):\n\treturn x ** 2",
    "Emoji: 😀🎉👍🏽🇯🇵 and symbols ©®™ ∑∫√",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "Numbers 1234567890 and 2024-01-01T12:00:00Z, x² ½",
]


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    tok = smollm2
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for t in SMOL_TEXTS:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        deltas = _stream(tok, ids)
        assert "".join(deltas) == t and not any("\ufffd" in d for d in deltas)
    # digits are split one by one (the "smollm" pre-tokenizer)
    assert [tok.id_to_token(i) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.apply_chat_template("What is 2+2?") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    )


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf_reader(smollm2):
    """transformers builds its own tokenizer from the same GGUF file: the encodings agree."""
    transformers = pytest.importorskip("transformers")
    from workbench.models import loader

    gguf_file = loader.default_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # transformers' GGUF reader ignores tokenizer.ggml.pre ("smollm": every \p{N} character is
    # split off first, as in llama.cpp and the original tokenizer.json). That only shows on
    # non-ASCII numerals after a space (" ½"), so those are left out of the comparison.
    texts = [t.replace(", x² ½", "") for t in SMOL_TEXTS] + ["<|im_start|>user\nhi<|im_end|>\n"]
    for t in texts:
        assert smollm2.encode(t) == ref(t, add_special_tokens=False)["input_ids"], t
    assert [smollm2.id_to_token(i) for i in smollm2.encode(" ½")] == ["Ġ", "Â½"]


# ----------------------------------------------------------------------------- length bound
def _bound_of(tk: HFTokenizer) -> int | None:
    return Tokenizer(tk).max_token_chars


def test_length_bound_is_a_lower_bound(smollm2):
    """No token stands for more characters than its vocabulary entry, so len(text) / longest
    entry never exceeds the true token count, whatever the text (the cheap refusal is safe)."""
    import random

    assert smollm2.max_token_chars == max(len(t) for t in smollm2.backend.get_vocab())
    rng = random.Random(0)
    vocab = list(smollm2.backend.get_vocab())
    texts = SMOL_TEXTS + [
        " " * 5000,
        "\n" * 3000,
        "a" * 10000,
        "word " * 3000,
        "".join(rng.choice(vocab).replace("Ġ", " ") for _ in range(4000)),
    ]
    for t in texts:
        assert smollm2.min_tokens(t) <= len(smollm2.encode(t)), t[:40]
    # the longest entry itself: one token, the bound says at least one
    longest = max(vocab, key=len)
    assert smollm2.min_tokens(longest) == 1


def test_check_fits_refuses_without_tokenizing(smollm2):
    limit = 8192
    text = "word " * (smollm2.max_token_chars * limit // 5 + 10)
    with pytest.raises(ValueError, match=r"characters, so at least [\d,]+ tokens .*context is 8192 tokens"):
        smollm2.check_fits(text, limit)
    smollm2.check_fits("word " * 100, limit)  # well under: passes
    assert smollm2.min_tokens("") == 0


def test_encode_releases_the_gil_and_matches_the_plain_path(smollm2):
    import threading
    import time

    text = "word " * 400_000
    assert (
        smollm2.encode(text[:5000], add_special_tokens=True)
        == smollm2.backend.encode(text[:5000], add_special_tokens=True).ids
    )
    ticks, stop = [], threading.Event()

    def spin():  # counts how often another Python thread gets to run during the encode
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    start = time.perf_counter()
    smollm2.encode(text)
    end = time.perf_counter()
    stop.set()
    t.join()
    during = [x for x in ticks if start < x < end]
    # Held GIL: no tick at all during a ~0.5 s encode. Released: hundreds (a loose floor).
    assert len(during) >= 0.1 * (end - start) / 0.001, (len(during), end - start)


@pytest.mark.parametrize(
    "setup, bound",
    [
        (lambda tk: None, "entry"),
        (lambda tk: setattr(tk, "pre_tokenizer", pre_tokenizers.WhitespaceSplit()), None),  # drops spaces
        (lambda tk: setattr(tk, "normalizer", __import__("tokenizers").normalizers.NFC()), "4x"),
        (lambda tk: setattr(tk, "normalizer", __import__("tokenizers").normalizers.Strip()), None),
        (lambda tk: setattr(tk, "normalizer", __import__("tokenizers").normalizers.Replace(" ", "\u2581")), "entry"),
        (lambda tk: setattr(tk, "normalizer", __import__("tokenizers").normalizers.Replace("ab", "")), None),
    ],
)
def test_length_bound_only_where_provable(setup, bound):
    tk = _byte_level_tokenizer()
    setup(tk)
    longest = max(len(t) for t in tk.get_vocab())
    expected = {"entry": longest, "4x": 4 * longest, None: None}[bound]
    assert _bound_of(tk) == expected


def test_no_length_bound_for_wordpiece():
    tk = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    assert _bound_of(tk) is None and Tokenizer(tk).min_tokens("x" * 10**6) == 0


def test_prefix_refusal_never_refuses_what_fits(smollm2):
    """encode_within refuses from a prefix's tokens only when the whole text has at least as
    many; what fits comes back exactly as encode() gives it."""
    import random

    rng = random.Random(1)
    vocab = [t.replace("Ġ", " ").replace("Ċ", "\n") for t in smollm2.backend.get_vocab()]
    pieces = vocab + [" ", "  ", "\n\n", "\t", "1234", "éa\u0301", "😀", " ,", "'s"]
    for trial in range(12):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(3000, 9000)))
        full = smollm2.encode(text)
        for limit in (len(full) - 1, len(full), len(full) + 1, len(full) // 3, 256):
            if limit < 1:
                continue
            try:
                got = smollm2.encode_within(text, limit)
            except ValueError as e:
                assert len(full) >= limit, (trial, limit, len(full), str(e))
                continue
            assert got == full


def test_prefix_refusal_without_spaces(smollm2):
    """Text with no word boundary (digits, letters, punctuation, emoji run together) is cut at a
    pre-tokenizer piece instead: never a refusal of what fits, and a long digit run is refused
    from a prefix, not tokenized whole (issue 32.6: 650,000 digits were encoded in full)."""
    import random

    rng = random.Random(2)
    vocab = [t for t in smollm2.backend.get_vocab() if "Ġ" not in t and "Ċ" not in t and t.strip()]
    pieces = vocab + ["1234", "9", "éa\u0301", "😀", ",", "'s", "...", "ﬁ"]
    for trial in range(12):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(3000, 9000)))
        assert " " not in text
        full = smollm2.encode(text)
        for limit in (len(full) - 1, len(full), len(full) + 1, len(full) // 3, len(full) // 9, 256):
            if limit < 1:
                continue
            try:
                got = smollm2.encode_within(text, limit)
            except ValueError as e:
                assert len(full) >= limit, (trial, limit, len(full), str(e))
                continue
            assert got == full
    with pytest.raises(ValueError, match="its first 16,383 alone are 16,383 tokens"):
        smollm2.encode_within("7" * 650_000, 8192)
