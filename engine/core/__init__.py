"""The engine core: `EngineCore` (engine_core.py) loads the model, sizes the KV pool and advances
every request by one step; loop.py steps it between commands; child_process.py is the child
process's side when it runs in one."""
