"""The training application (`amsp train`): config.py (TrainConfig, every flag), loop.py (the
loop every rank runs), state.py (resumable state), data.py, models.py, metrics.py (the one MFU
definition), supervise.py (the launcher's watchdog) and faults.py (fault injection for tests).

Empty on purpose: the runtime imports the two leaf modules ``metrics`` and ``faults``, and
importing them must not import the loop.
"""
