"""The engine core: EngineCore and what runs beside it, in its own process (process.py) or in a
thread of the caller (engine/core_client.py)."""
