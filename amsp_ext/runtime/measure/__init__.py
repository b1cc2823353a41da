"""Measurement: `amsp profile`'s loop and cases, the collectives trace, the MFU peak."""
