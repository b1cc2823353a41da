"""The measured side-by-side harness (``amsp compare``): baselines and AMSP on the same job.

Layering: this package sits at the integrations/CLI level. It may import the planner, topology,
runtime (``amsp_ext.shard``) and the baselines' libraries; nothing below imports it.

- ``config``: RunSpec, what every system shares.
- ``systems/``: one small runner per system, ``setup(name, model, ctx) -> SystemRun``.
- ``worker``: the torchrun-able module that runs one system on every rank.
- ``launch``: torchrun or ``amsp cluster run``, one job per system; failures become reasons.
- ``memory``, ``trace``: how memory and exposed communication are measured (FLOPs and the
  matmul peak come from :mod:`amsp_ext.common.metrics`, shared with `amsp train`).
- ``summary``, ``report``: rows, the markdown table, JSON and plots.
- ``harness``: modes (baselines, dissociation, ablation) and the run.
- ``rounds``: ``--repeats N``: the order of each round, medians and per-round ratios.
"""
