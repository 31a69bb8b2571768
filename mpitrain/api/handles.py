"""Waiting on the handles that the asynchronous collectives return.

The waiting itself lives with the handles in the engine (engine/handles.py);
this module is the public door to it, so that the adapters and users reach
poll, synchronize and groups of handles through the API and the engine can
move its rooms about without breaking them.
"""

from mpitrain.engine.handles import GroupHandle, poll, synchronize, synchronize_all

__all__ = ["GroupHandle", "poll", "synchronize", "synchronize_all"]
