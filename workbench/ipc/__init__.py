"""The engine as a shared, long-lived process: ZeroMQ transport, discovery and clients.

- `protocol`: typed msgpack messages (no pickle), protocol version, error mapping;
- `connection`: the private runtime dir and per-engine connection files;
- `server`: the engine process (step loop + IO threads), `python -m workbench.ipc.server`;
- `client`: `EngineClient` and `start_engine`.
"""
