"""``amsp tune``: measure candidate plans on the real cluster, compare them with the planner's
predictions, and calibrate its step model (see amsp_ext/cli/tune.py)."""
