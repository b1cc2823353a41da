"""Run torchrun so that nothing outlives the launcher: the process tree of ``amsp train``.

    amsp train (launcher)          temp dir amsp-train-XXXX (TMPDIR of everything below)
      └─ agent: torchrun in-process   own process group; SIGTERM when the launcher dies
           └─ ranks (own sessions)    SIGKILL when the agent dies

[Note: no orphans]
- The agent (``python -m amsp_ext.train.supervise``, torchrun run in-process) starts in its own
  process group with a parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): if the
  launcher dies in any way, SIGKILL included, the agent gets SIGTERM, torchrun stops its ranks
  (SIGTERM, then SIGKILL after a grace period) and the agent removes the job's temp directory.
- torchrun starts every rank in a session of its own, so signals to the agent's group do not
  reach them; each rank sets its own parent-death signal (SIGKILL) first thing
  (:func:`die_with_parent`), so a rank never outlives the agent, even one killed with -9.
- The launcher forwards SIGINT/SIGTERM/SIGHUP to the agent's group, then the one reaper
  (amsp_ext/reap.py) gives the agent's tree ``GRACE_S`` and SIGKILLs what is left; on any exit
  it stops the tree the same way and removes the temp directory. torchrun's own temp files
  (``torchelastic_*``) live inside it (TMPDIR).
- Each check against a lost race: a child that finds its parent already gone when it
  installs the parent-death signal exits at once.

[Note: one line on failure]
A rank that fails with a known error writes it (one line) to ``<job dir>/error-<attempt>-<rank>``
instead of a traceback (:func:`report_error`); the agent writes how ranks exited (torchrun's
failures, after the last attempt) to ``<job dir>/failures.json``, and the launcher prints one line from these:
the lowest rank's error of the last attempt, else which rank died of which signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from amsp_ext.reap import stop_job

__all__ = ["Job", "die_with_parent", "report_error"]

_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
JOB_DIR_ENV, LAUNCHER_ENV, AGENT_ENV = "AMSP_JOB_DIR", "AMSP_LAUNCHER_PID", "AMSP_AGENT_PID"


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a rank started by the agent: get ``sig`` when the agent dies (and exit now if it
    already has). A no-op outside ``amsp train``."""
    agent = os.environ.get(AGENT_ENV)
    if not agent:
        return
    _set_parent_death_signal(sig)
    if os.getppid() != int(agent):
        os._exit(1)


def report_error(exc: BaseException) -> bool:
    """A rank's one-line error for the launcher (True), or False outside ``amsp train``."""
    job = os.environ.get(JOB_DIR_ENV)
    if not job or not os.path.isdir(job):
        return False
    rank = os.environ.get("RANK", "0")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    with open(os.path.join(job, f"error-{attempt}-{rank}"), "w") as f:
        f.write(line)
    return True


class Job:
    """``with Job("amsp-train-") as job: rc = job.run(torchrun_args, env=...)``: the temp
    directory ``job.dir`` exists inside the block and is gone after it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.signal: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "Job":
        self.dir = Path(tempfile.mkdtemp(prefix=self.prefix))
        for sig in _FORWARDED:
            self._old[sig] = signal.signal(sig, self._forward)
        return self

    def _forward(self, signum, _frame) -> None:
        self.signal = self.signal or signum
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def run(self, torchrun_args: list[str], *, env: dict, stdout=None) -> int:
        """Run torchrun with ``torchrun_args`` under the agent; its exit status (128 + N when
        the launcher got signal N)."""
        env = {**env, JOB_DIR_ENV: str(self.dir), LAUNCHER_ENV: str(os.getpid()), "TMPDIR": str(self.dir)}
        if self.signal is not None:  # interrupted before anything started
            return 128 + self.signal
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "amsp_ext.train.supervise", *torchrun_args], env=env, stdout=stdout,
            process_group=0, preexec_fn=lambda: _set_parent_death_signal(signal.SIGTERM))
        while True:
            try:
                rc = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if self.signal is not None:  # _forward already sent it: the grace, then SIGKILL
                stop_job(self.proc.pid, signalled=True)
                rc = self.proc.wait()
                break
        return 128 + self.signal if self.signal is not None else rc

    def output(self) -> str | None:
        """The agent's stdout when ``run(stdout=PIPE)``."""
        return self.proc.stdout.read().decode() if self.proc and self.proc.stdout else None

    def error_line(self, rc: int) -> str:
        """One line saying why the job failed (see [Note: one line on failure])."""
        if self.signal is not None:
            return f"interrupted by {signal.Signals(self.signal).name}; the job was stopped"
        killed, stopped = [], []
        if (self.dir / "failures.json").is_file():
            for rank, code in sorted(json.loads((self.dir / "failures.json").read_text()).items(),
                                     key=lambda kv: int(kv[0])):
                if code < 0:  # SIGTERM: most likely torchrun stopping the others after a failure
                    (stopped if -code == signal.SIGTERM else killed).append(
                        f"rank {rank} was killed by {signal.Signals(-code).name}")
        errors = [(tuple(map(int, p.name.split("-")[1:])), p) for p in self.dir.glob("error-*-*")]
        if errors:  # the last attempt's, lowest rank first
            last = max(a for (a, _), _ in errors)
            first = min((r, p) for (a, r), p in errors if a == last)[1]
            return "; ".join(killed + [first.read_text().strip()])
        return "; ".join(killed or stopped) or f"ranks exited with status {rc}"

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # leaving on an error: no grace
            stop_job(self.proc.pid, grace_s=0)
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self._kill()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the agent -----------------------------------------------------------------------------------
def _agent(argv: list[str]) -> int:
    launcher = int(os.environ[LAUNCHER_ENV])
    if os.getppid() != launcher:
        return 1  # the launcher died before the parent-death signal was set
    os.environ[AGENT_ENV] = str(os.getpid())
    job = Path(os.environ[JOB_DIR_ENV])

    def stop(signum, _frame):  # until torchrun installs its own handlers (and after)
        raise SystemExit(128 + signum)

    for sig in _FORWARDED:
        signal.signal(sig, stop)
    # the launcher prints one line on failure; a restart is logged by the resumed ranks
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # elastic's modules set their own loggers' levels (get_logger): quiet each of them too, so
    # that Ctrl-C is the launcher's one line and not also "Received 2 death signal"
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(lg, logging.Logger):
            lg.setLevel(logging.CRITICAL)

    from amsp_ext.tools.rendezvous import bound_torchrun_args, register

    register()  # the store bound to the master address (tools/rendezvous.py)
    try:
        run(parse_args(bound_torchrun_args(argv)))
        return 0
    except ChildFailedError as e:  # the last attempt failed: say how each rank ended
        (job / "failures.json").write_text(json.dumps({str(r): f.exitcode for r, f in e.failures.items()}))
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        if os.getppid() != launcher:  # the launcher is gone: nobody else will clean up
            shutil.rmtree(job, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1:]))
