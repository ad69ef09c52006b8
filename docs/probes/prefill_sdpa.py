"""Prefill attention on a CPU: our C extend kernel against torch's SDPA (what the C backend's
`prefill_attention` chooses between), one causal prompt at SmolLM2's heads (9/3, d64), bf16, the
median of 7 calls each; fresh prompts (is_causal) and new tokens after cached keys (a bool mask).
Where the CPU has AMX, our kernel is timed on it and on AVX-512 alone (`cpu.set_amx(False)`).

    python docs/probes/prefill_sdpa.py
"""

import torch
import torch.nn.functional as F
from workbench_kernels import cpu
from workbench_kernels.bench import Timer

HQ, HKV, D, BS = 9, 3, 64, 16


def case(n: int, cached: int) -> None:
    span = cached + n
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, HQ, D, generator=g).bfloat16()
    k, v = (torch.randn(span, HKV, D, generator=g).bfloat16() for _ in "kv")
    blocks = -(-span // BS)
    kc, vc = (torch.zeros(blocks, BS, HKV, D, dtype=torch.bfloat16) for _ in "kv")
    kc.view(-1, HKV, D)[:span], vc.view(-1, HKV, D)[:span] = k, v
    table = torch.arange(blocks, dtype=torch.int32)[None]
    cu, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([span], dtype=torch.int32)
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    mask = torch.ones(n, span, dtype=torch.bool).tril(cached) if cached else None

    def ours():
        return cpu.extend_attention(q, kc, vc, table, cu, lens, D**-0.5)

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=not cached, enable_gqa=True)
        return out[0].transpose(0, 1)

    timer = Timer("cpu")
    a, b = timer(ours, iters=7, warmup=1), timer(sdpa, iters=7, warmup=1)
    err = (ours().float() - sdpa().float()).abs().max().item()
    what = f"{n:5d} new after {cached:4d} cached"
    line = f"{what}: ours {a * 1e3:7.3f} ms  SDPA {b * 1e3:7.3f} ms  {a / b:4.2f}x  max diff {err:.3g}"
    if cpu.extend_on_amx(HQ, HKV, D):
        cpu.set_amx(False)
        c = timer(ours, iters=7, warmup=1)
        cpu.set_amx(None)
        line += f"  (on AMX; on AVX-512 {c * 1e3:.3f} ms, {c / b:4.2f}x)"
    print(line)


if __name__ == "__main__":
    for n in (32, 128, 512, 1024, 2048):
        case(n, 0)
    for n, cached in ((314, 200), (64, 386), (28, 272)):
        case(n, cached)
