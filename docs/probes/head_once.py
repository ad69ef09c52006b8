"""The output head holding its weights in the tiles' layout (on AMX, `Transformer.pack_tiles`; a tied
embedding then looked up there) against the head laid back as before (its plain weights for the
GEMVs, a tiles copy made at the first step of many sequences): two engines in one process, their
requests interleaved so the host's drift cancels. Single-stream decode tok/s, a batch of 16's ITL,
a prompt's TTFT (medians over the rounds), and what each engine holds.

    python docs/probes/head_once.py [--model shape:llama3.2-1b] [--rounds 5]
"""

import argparse

from weights_once import interleaved  # this folder's probe: the same interleaved measurement

from workbench import LLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shape:llama3.2-1b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    args = ap.parse_args()
    engines = {"head held": LLM(model=args.model), "head copied": LLM(model=args.model)}
    engines["head copied"].engine.runner.model.lm_head.quantize("none")  # laid back, on the GEMV again
    results = interleaved(engines, args.rounds, args.prompt, batch=16)
    for name, llm in engines.items():
        tok_s, itl16, ttft = results[name]
        print(
            f"{name} ({llm.engine.runner.model.lm_head.held_once}): single {tok_s:.1f} tok/s; batch 16 ITL "
            f"{itl16 * 1e3:.1f} ms; {args.prompt}-token TTFT {ttft * 1e3:.0f} ms; "
            f"memory_mb {llm.engine.status()['memory_mb']}"
        )


if __name__ == "__main__":
    main()
