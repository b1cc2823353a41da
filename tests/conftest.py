"""[Note: test tiers]
``python -m pytest -q`` (README's test command) runs the default tier: every unit, numeric and
distributed test but those marked ``slow``, in 12-15 minutes on the 2-core machine. The
suite as a whole took 17-20 minutes there, most of it process start-up: a rank spends about
5 s of CPU importing torch and transformers (``import deepspeed`` alone: 9 s), and a launch
through torchrun or `amsp train` pays that once per rank plus its agent (tests/fork_launch.py
already forks the ranks of every test that does not test the launch path itself).

``slow`` marks the few long end-to-end runs whose code paths the default tier also reaches more
cheaply; each marked place names the default-tier test that does:
- tests/test_integrations_scripts.py: third-party-style scripts on every route, twice each;
- tests/test_train_resume.py: `amsp train --resume` across world sizes, the elastic restart;
- tests/test_compare_hang.py's hung-system run (the harness waits out a 30 s timeout);
- the 8-rank case of tests/test_engine_parity.py (the 4-rank case runs every code path);
- tests/test_compare_harness.py's DeepSpeed row end to end (test_compare_repeats.py launches the
  harness's DDP and AMSP rows; DeepSpeed's own engine runs in this tier only);
- SIGINT to `amsp train` (forwarded as SIGTERM is; test_train_supervise.py).
``python -m pytest -q -m slow`` runs them (354 s in one run); .ci/run runs both tiers, so
nothing leaves CI.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
