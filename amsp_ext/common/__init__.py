"""What the engine, the tools and the applications share, below all of them: the built-in models
(models.py), deterministic real-text batches (data.py), the one MFU definition (metrics.py) and
fault injection for tests (faults.py).

[Note: common is a leaf]
These modules import the planner and ``choices`` at most, never the runtime, the topology or
anything above: the engine (runtime/) imports them, so an import back up would make the engine
depend on the applications it serves (tests/test_imports.py).
"""
