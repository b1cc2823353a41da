"""[Note: test tiers]
``python -m pytest -q`` (README's test command; README gives its budget, and
comparisons/results/design_history.md "Test tier timings" the measured times) runs the default
tier: every test but those marked ``slow``. Most of the suite's time is process start-up: a
rank spends about 5 s of CPU importing torch and transformers (``import deepspeed`` alone: 9 s),
and a launch through torchrun or `amsp train` pays that once per rank plus its
agent (tests/fork_launch.py already forks the ranks of every test that does not test the launch
path itself).

``slow`` marks the few long end-to-end runs whose code paths the default tier also reaches more
cheaply; each mark names the default-tier test that does (``python -m pytest -q --collect-only
-m slow`` lists them). ``python -m pytest -q -m slow`` runs them; .ci/run runs both tiers, so
nothing leaves CI.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(autouse=True, scope="session")
def _own_profile_cache(tmp_path_factory):
    """Plan "auto" caches the profiles it measures (topology/profile_cache.py): the suite's go to
    a directory of its own, never the user's cache, and no test sees a profile a user's job left."""
    before = os.environ.get("AMSP_PROFILE_CACHE")
    os.environ["AMSP_PROFILE_CACHE"] = str(tmp_path_factory.mktemp("amsp-profile-cache"))
    yield
    if before is None:
        os.environ.pop("AMSP_PROFILE_CACHE")
    else:
        os.environ["AMSP_PROFILE_CACHE"] = before
