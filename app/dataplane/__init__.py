"""The data plane: HTTP worker processes in front of one engine process per device.

    HTTP worker (app.main, N of them)              engine process (one per device)
    RemoteEngine ── Unix socket, descriptors ────> EngineServer -> Engine -> Worker -> backend
         └──── operands and product in the worker's shared-memory arena (pinned by the engine) ────┘

`slab` (the shared memory), `wire` (the control channel), `remote` (the HTTP worker's side), `engine_process` (the
engine's side) and `supervisor` (starting and restarting the engine processes). docs/architecture.md draws it.
"""
