"""Gradient and parameter synchronisation: the FSDP2 units (units.py, param_shard.py), the bucketed
AllReduce with select & drop (grad_sync.py) and the owners' Broadcasts (param_sync.py)."""
