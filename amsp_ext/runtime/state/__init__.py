"""Checkpoints (checkpoint.py, any plan and world size), their files (checkpoint_files.py) and
Hugging Face export (export.py)."""
