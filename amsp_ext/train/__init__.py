"""The training application (`amsp train`): config.py (TrainConfig, every flag), loop.py (the
loop every rank runs), state.py (resumable state) and supervise.py (the launcher's watchdog).
Its models, data, metrics and fault injection are amsp_ext/common/, shared with the engine and
the other tools.

Empty on purpose: importing config.py (torch-free, read by `amsp --help`) must not import the loop.
"""
