"""The bf16 layers' weights held once, in the tiles' layout (`cpu.tiles_hold_weights`: on AMX), against
both copies kept (WORKBENCH_CPU_WEIGHTS_ONCE=0: the plain one for the GEMVs beside the tiles), as two
engines in one process, their requests interleaved so the host's drift cancels: single-stream decode
tok/s and a batch of 8's ITL (medians over the rounds), a prompt's TTFT, and what each engine holds
(`status()["memory_mb"]`).

    python docs/probes/weights_once.py [--model shape:llama3.2-1b] [--rounds 5]
"""

import argparse
import os
import statistics

from workbench import LLM, SamplingParams


def interleaved(engines: dict, rounds: int, prompt: int, batch: int = 8) -> dict:
    """Per engine, medians over `rounds` of single-stream decode tok/s, a batch's ITL (s) and a
    `prompt`-token TTFT (s); the engines' requests alternate, each first in every other round."""
    greedy = dict(temperature=0, ignore_eos=True)
    tok_s, itl, ttft = ({n: [] for n in engines} for _ in range(3))
    for r in range(rounds):
        for name, llm in sorted(engines.items(), reverse=r % 2 == 1):
            one = llm.generate(prompt_token_ids=[[11 + r] * 16], params=SamplingParams(max_tokens=48, **greedy))[0]
            tok_s[name].append(1 / statistics.median(one.metrics.itl))
            outs = llm.generate(
                prompt_token_ids=[[13 + r + i] * 16 for i in range(batch)],
                params=SamplingParams(max_tokens=24, **greedy),
            )
            itl[name].append(statistics.median(t for o in outs for t in o.metrics.itl))
            ttft[name].append(
                llm.generate(prompt_token_ids=[[17 + r] * prompt], params=SamplingParams(max_tokens=1, **greedy))[
                    0
                ].metrics.ttft
            )
    med = statistics.median
    return {n: (med(tok_s[n]), med(itl[n]), med(ttft[n])) for n in engines}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=1536)
    args = ap.parse_args()
    engines = {}
    for name, flag in (("twice", "0"), ("once", "1")):
        os.environ["WORKBENCH_CPU_WEIGHTS_ONCE"] = flag  # read as each engine lays out its layers
        engines[name] = LLM(model=args.model)
    results = interleaved(engines, args.rounds, args.prompt)
    for name, llm in engines.items():
        held = all(lin.held_once for layer in llm.engine.runner.model.layers for lin in layer.linears())
        tok_s, itl8, ttft = results[name]
        print(
            f"{name} (held once: {held}): single {tok_s:.1f} tok/s; batch 8 ITL {itl8 * 1e3:.1f} ms; "
            f"{args.prompt}-token TTFT {ttft * 1e3:.0f} ms; memory_mb {llm.engine.status()['memory_mb']}"
        )


if __name__ == "__main__":
    main()
