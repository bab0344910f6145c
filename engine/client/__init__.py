"""The service's side of the engine: `EngineClient` (engine_client.py), which validates and submits
requests and streams their outputs, over the engine core run on a thread of this process
(thread.py) or in a child process (process.py)."""
