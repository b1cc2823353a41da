"""Measurement inside a run: the collectives trace, the MFU peak, the CPU bf16 probe. The tools
that measure from outside (`amsp profile`, `amsp dryrun`) are amsp_ext/tools/."""
