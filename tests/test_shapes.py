"""Model shapes: the published configs of the models researchers run, with random weights made where
the engine runs (issue 50, item 1). Exactness on the one shape a CPU runs whole (SmolLM2's),
against transformers holding the same weights; the others by their parameter counts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from workbench.bench.peers import load_hf_model
from workbench.llm import LLM
from workbench.models import shapes
from workbench.models.config import expected_weight_shapes
from workbench.sampling_params import SamplingParams

# published parameter counts (the model cards), tied embeddings counted once
PARAMS = {
    "llama3-8b": 8.03e9,
    "llama3.1-8b": 8.03e9,
    "llama3.2-1b": 1.24e9,
    "qwen2.5-7b": 7.62e9,
    "smollm2-135m": 134.5e6,
}


def test_every_shape_has_its_published_size():
    assert shapes.shape_names() == sorted(PARAMS)
    for name, published in PARAMS.items():
        config = shapes.shape_config(name)
        n = sum(math.prod(s) for s in expected_weight_shapes(config).values())
        assert n == pytest.approx(published, rel=0.01), (name, n)
    assert shapes.shape_config("qwen2.5-7b").attention_bias  # Qwen2's q/k/v biases
    assert shapes.shape_config("llama3.1-8b").rope_scaling["rope_type"] == "llama3"


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model shape 'llama9'; known: llama3-8b, .*smollm2-135m"):
        LLM("shape:llama9")
    out = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "gpucheck", "--dry-run", "--shape", "llama9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "unknown model shape 'llama9'" in out.stderr, out.stderr


def test_a_shape_serves_what_transformers_computes_on_the_same_weights():
    """SmolLM2's shape, random weights from one seed in both: our engine's log-probabilities of a
    sequence equal transformers' (fp32), and the weights are the same tensors, not alike ones."""
    llm = LLM("shape:smollm2-135m", dtype="float32")
    assert llm.status()["weights_checksum"] == "random weights of shape smollm2-135m (seed 0)"
    hf = load_hf_model("shape:smollm2-135m", torch.float32)
    ours = shapes.load_shape("smollm2-135m", torch.float32).weights
    theirs = hf.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in ours.items())
    ids = [1, 500, 600, 700, 800, 900, 31, 4000]
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    expected = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert llm.score(ids) == pytest.approx(expected, abs=1e-4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [out] = llm.generate(prompt_token_ids=[ids], params=params)  # token ids in: a shape has no tokenizer
    assert len(out.token_ids) == 4


def test_generate_cli_runs_a_shape_on_token_ids(capsys):
    """`workbench generate` on a shape: text is refused before anything loads, naming --token-ids;
    with token ids it prints the token ids the engine generates (the same as in process)."""
    from workbench.cli import main

    assert main(["generate", "--model", "shape:smollm2-135m", "Once upon a time"]) == 2
    assert "no tokenizer: give the prompt as token ids with --token-ids" in capsys.readouterr().err
    assert main(["generate", "--model", "shape:llama9", "--token-ids", "1 2"]) == 2
    assert "unknown model shape 'llama9'; known:" in capsys.readouterr().err
    assert main(["generate", "--model", "shape:smollm2-135m", "--token-ids", "1 two 3"]) == 2
    assert "PROMPT must be token ids separated by spaces or commas" in capsys.readouterr().err
    assert main(["generate", "--model", "shape:smollm2-135m", "--token-ids", "1 2", "--chat"]) == 2
    assert "not with --token-ids" in capsys.readouterr().err
    assert main(["generate", "--model", "shape:smollm2-135m", "--token-ids", "1 99999999"]) == 2
    assert "outside the vocabulary [0, 49152): [99999999]" in capsys.readouterr().err

    ids = [1, 500, 600, 700]
    args = ["--model", "shape:smollm2-135m", "--dtype", "float32", "--max-tokens", "5", "--ignore-eos"]
    assert main(["generate", "--token-ids", ",".join(map(str, ids)), *args]) == 0
    captured = capsys.readouterr()
    [out] = LLM("shape:smollm2-135m", dtype="float32").generate(
        prompt_token_ids=[ids], params=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert captured.out.split() == [str(t) for t in out.token_ids]
    assert "5 tokens" in captured.err
