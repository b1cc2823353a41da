"""Another plan mid-run: switch_plan (switch.py) and adaptive AMSP's monitor (adaptive.py)."""
