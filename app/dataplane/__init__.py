"""The data plane: HTTP worker processes in front of one engine process per device.

    HTTP worker (app.main, N of them)              engine process (one per device)
    EngineClient ── Unix socket, wire messages ──> EngineServer -> DeviceWorker -> backend
         └──── operands and product in the worker's shared-memory arena (pinned by the engine) ────┘

`slab` (the shared memory), `wire` (the control channel's messages), `engine_client` (the HTTP worker's side:
`EngineClient`), `engine_process` (the engine's side: `EngineServer`) and `supervisor` (starting and restarting the
engine processes). docs/architecture.md draws it.
"""
