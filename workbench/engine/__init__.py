"""The engine core, stepped by its owner (`LLM` in a process, or the engine process's loop).

- `llm_engine`: `LLMEngine`: `add_request`, `step` (schedule -> run the model -> sample ->
  update state -> emit outputs) and `configure`;
- `live_settings`: what a live setting's change does (validate, re-lay out, record);
- `scheduler`: who runs this step, and every sequence and KV-block state change after it;
- `block_manager`: paged KV blocks and the prefix cache (touched by the scheduler only);
- `model_runner`: a scheduled batch as one flat forward over the paged cache;
- `attention`: the KV cache and the attention backends (torch, Triton, C kernels);
- `hostload`: the host's CPU load beside the engine (the dashboard's host plot);
- `sampler`, `speculative` (propose / verify), `output_processor` (what callers get back),
  `sequence` (a request's token state).
"""
