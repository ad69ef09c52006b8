"""The engine core, stepped by its owner (`LLM` in a process, or the engine process's loop).

- `llm_engine`: `LLMEngine`: the core (`core_add`, `core_step`: schedule -> run the model ->
  sample -> update state -> new token ids out) and `configure`; `add_request` and `step` for
  in-process callers, which also run the output processor (`workbench.processing.output`);
- `live_settings`: what a live setting's change does (validate, re-lay out, record);
- `scheduler`: who runs this step, and every sequence and KV-block state change after it;
- `block_manager`: paged KV blocks and the prefix cache (touched by the scheduler only);
- `model_runner`: a scheduled batch as one flat forward over the paged cache;
- `attention`: the KV cache and the attention backends (torch, Triton, C kernels);
- `hostload`: the host's CPU load beside the engine (the dashboard's host plot);
- `sampler`, `speculative` (propose / verify), `emitter` (the stops that free KV, finishes, the
  `CoreOutput`s), `sequence` (a request's token state).
"""
