"""Tools above the engine that build models or spawn processes: the dry run (dryrun.py,
dryrun_report.py: `amsp dryrun`) and the static rendezvous (rendezvous.py: ``python -m amsp_ext.tools.rendezvous``,
what every launcher runs in place of torchrun).

They import the engine (runtime/), the topology, the planner and common/; the engine imports none
of them (tests/test_imports.py), and the applications (train/, compare/, tune/, cli/) may.
"""
