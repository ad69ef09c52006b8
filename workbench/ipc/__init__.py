"""The engine as a shared, long-lived process: ZeroMQ transport, discovery and clients.

- `protocol`: typed msgpack messages (no pickle), protocol version, error mapping;
- `connection`: the private runtime dir and per-engine connection files;
- `server`: the engine process (step loop + IO threads); `engine_main`: its entry point,
  `python -m workbench.ipc.engine_main` (and `workbench serve`);
- `client`: `EngineClient`, the engine interface over that protocol; `launch`: `start_engine`.
"""
