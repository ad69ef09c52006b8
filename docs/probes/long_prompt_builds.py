"""One round of the long-prompt workload (8 streams decode, then an 8,000-token prompt arrives) on
whichever checkout is first on sys.path, at that checkout's default settings; prints its TTFT and
the streams' worst gap as JSON. Alternate two checkouts round by round to compare builds on one
host (a shared host's speed moves by 10-20% within minutes):

    for i in 1 2 3 4 5; do for tree in /tmp/old /work/main; do
      python -c "import sys; sys.path.insert(0, '$tree/.dev'); sys.argv = ['x', '$i'];
                 exec(open('docs/probes/long_prompt_builds.py').read())"; done; done

(`.dev` holds links named workbench and workbench_kernels to the checkout's packages, as `make
setup` makes them.) The argument seeds the prompts. It repeats the loop of `bench.scenarios`'
long_prompt scenario on purpose: checkouts older than that scenario have only the engine's API.
"""

import json
import random
import sys
import time

from workbench.llm import LLM
from workbench.sampling_params import SamplingParams

llm = LLM(None, dtype="bfloat16", prefix_caching=False)
eng = llm.engine
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
V = eng.model_config.vocab_size
decode = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
ids = [eng.add_request(None, decode, prompt_token_ids=[rng.randrange(5, V) for _ in range(16)]) for _ in range(8)]
times: dict[str, list[float]] = {r: [] for r in ids}
long_id = arrived = first = None
while first is None:
    for out in eng.step():
        if out.request_id in times and out.token_ids_delta:
            times[out.request_id].append(time.monotonic())
        if out.request_id == long_id and out.token_ids_delta:
            first = time.monotonic()
    if long_id is None and min(len(v) for v in times.values()) >= 5:  # every stream decoding
        arrived = time.monotonic()
        prompt = [rng.randrange(5, V) for _ in range(8000)]
        long_id = eng.add_request(None, SamplingParams(max_tokens=1, temperature=0), prompt_token_ids=prompt)
gaps = [b - a for v in times.values() for a, b in zip(v, v[1:]) if b >= arrived]
print(json.dumps({"ttft_s": round(first - arrived, 3), "worst_gap_ms": round(max(gaps) * 1e3, 1)}))
