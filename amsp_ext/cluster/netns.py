"""Run the lab's command lists (root): bring a lab up, find it, tear it down.

[Note: crash safety]
``up`` writes the state file *before* its first command, so a lab half-built by a crash is still
recorded; ``down`` removes whatever `ip netns list` shows with the lab's prefix (``<name>-fab``,
``<name>-n<i>``; a namespace only the state file names is already gone), then the state file,
after stopping any process still inside a node namespace (a rank of a crashed ``cluster run``).
A namespace holds all the lab's interfaces, bridges and qdiscs, so deleting the namespaces
removes everything; ``down`` then checks the host's own interface list for the prefix too.
Running it twice is harmless.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Sequence

from amsp_ext.cluster.lab import (NAME_RE, Lab, LabError, LabSpec, down_commands, lab_namespace_re, parse_rate,
                                  set_rate_commands, up_commands)
from amsp_ext.reap import stop_job

__all__ = ["Runner", "down", "find_leftovers", "load_state", "preflight", "set_bandwidth", "state_path", "up"]

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]
STATE_DIR_ENV = "AMSP_CLUSTER_STATE_DIR"
DEFAULT_STATE_DIR = "/run/amsp-cluster"


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def preflight() -> None:
    """One-line errors, with the fix, for the two things a lab needs."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        raise LabError(
            f"iproute2 is missing ({', '.join(missing)} not on PATH); install it: "
            f"apt-get install -y iproute2 (Debian/Ubuntu) or dnf install -y iproute-tc"
        )
    if os.geteuid() != 0:
        raise LabError(
            "creating network namespaces needs root; run it as root, e.g. "
            "sudo -E env PATH=\"$PATH\" amsp cluster ..."
        )


def load_state(name: str) -> dict | None:
    path = state_path(name)
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LabError(f"lab state file {path} is unreadable ({e}); remove it or run `amsp cluster down`")


def _write_state(name: str, state: dict) -> None:
    path = state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)


def list_namespaces(runner: Runner = run_command) -> list[str]:
    out = runner(["ip", "netns", "list"])
    # lines look like "amsp-n0 (id: 3)" or just "amsp-n0"
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def host_interfaces(runner: Runner = run_command) -> list[str]:
    out = runner(["ip", "-o", "link", "show"])
    names = []
    for line in out.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def find_leftovers(name: str, runner: Runner = run_command) -> tuple[list[str], list[str]]:
    """(namespaces, host interfaces) carrying lab ``name``'s prefix."""
    pattern = lab_namespace_re(name)
    namespaces = [n for n in list_namespaces(runner) if pattern.match(n)]
    interfaces = [i for i in host_interfaces(runner) if i.startswith(f"{name}-")]
    return namespaces, interfaces


def check_subnet_free(lab: Lab, runner: Runner = run_command) -> None:
    """The lab's addresses never leave its namespaces, but a subnet the host also uses would
    confuse anyone reading addresses; refuse it."""
    out = runner(["ip", "-o", "-4", "addr", "show"])
    for line in out.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            net = ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network
            if net.overlaps(lab.network):
                raise LabError(
                    f"subnet {lab.network} overlaps the host's {net} on {parts[1]}; "
                    f"pick another with --subnet (e.g. 10.78.0.0/24)"
                )


def _explain(argv: Sequence[str], proc: subprocess.CompletedProcess) -> str:
    err = (proc.stderr or proc.stdout or "").strip().splitlines()
    first = err[0].rstrip(".") if err else f"exit status {proc.returncode}"
    hint = ""
    if "netem" in argv and ("unknown" in first.lower() or "no such file" in first.lower()):
        hint = ("; --latency needs the netem qdisc (kernel module sch_netem), which this kernel "
                "lacks: drop --latency or load sch_netem")
    elif "tbf" in argv and "unknown" in first.lower():
        hint = "; the tbf qdisc (kernel module sch_tbf) is missing from this kernel"
    return f"`{' '.join(argv)}` failed: {first}{hint}"


def up(spec: LabSpec, *, runner: Runner = run_command, log: Callable[[str], None] = lambda s: None) -> dict:
    """Build the lab; on any failure, remove what was built and raise a one-line LabError."""
    preflight()
    lab = Lab(spec=spec)
    cmds = up_commands(lab)  # validates names first
    if load_state(spec.name) is not None:
        raise LabError(f"lab {spec.name!r} is already up; run `amsp cluster down --name {spec.name}` first")
    leftover_ns, leftover_if = find_leftovers(spec.name, runner)
    if leftover_ns or leftover_if:
        raise LabError(
            f"found leftovers of lab {spec.name!r} ({', '.join(leftover_ns + leftover_if)}); "
            f"run `amsp cluster down --name {spec.name}` first"
        )
    check_subnet_free(lab, runner)
    state = {
        "spec": spec.as_dict(),
        "namespaces": lab.namespaces(),
        "status": "creating",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "link": lab.link_settings(),
        "nodes": [
            {"node": i, "namespace": lab.node_ns(i), "address": lab.node_address(i),
             "ifname": lab.node_ifname, "leaf": spec.leaf_of(i)}
            for i in range(spec.num_nodes)
        ],
    }
    _write_state(spec.name, state)
    for argv in cmds:
        proc = runner(argv)
        if proc.returncode != 0:
            message = _explain(argv, proc)
            down(spec.name, runner=runner)
            raise LabError(f"cluster up: {message} (rolled back)")
    state["status"] = "up"
    _write_state(spec.name, state)
    log(f"lab {spec.name!r} up: {spec.num_nodes} node(s) x {spec.gpus_per_node} rank(s), "
        f"{state['link']['inter']}" + (f"; spine {state['link']['spine']}" if "spine" in state["link"] else ""))
    return state


def set_bandwidth(name: str, rate: str, *, runner: Runner = run_command,
                  log: Callable[[str], None] = lambda s: None) -> dict:
    """Change a running lab's node-link rate (``tc qdisc change``); the state file follows."""
    bits = parse_rate(rate, "--inter-node-bandwidth")
    preflight()
    state = load_state(name)
    if state is None or state.get("status") != "up":
        raise LabError(f"cluster set: lab {name!r} is not up; start it with `amsp cluster up --name {name} ...`")
    spec = LabSpec.from_dict({**state["spec"], "inter_node_bandwidth": rate})
    lab = Lab(spec=spec)
    for argv in set_rate_commands(lab, bits):
        proc = runner(argv)
        if proc.returncode != 0:
            raise LabError(f"cluster set: {_explain(argv, proc)}")
    state["spec"], state["link"] = spec.as_dict(), lab.link_settings()
    _write_state(name, state)
    log(f"lab {name!r}: {state['link']['inter']}")
    return state


def _stop_processes(namespace: str, runner: Runner, log: Callable[[str], None]) -> None:
    """Stop processes still running inside a lab namespace (ranks of a crashed `cluster run`)."""
    out = runner(["ip", "netns", "pids", namespace])
    pids = [int(p) for p in out.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    if not pids:
        return
    log(f"stopping {len(pids)} process(es) left in {namespace}: {' '.join(map(str, pids))}")
    stop_job(None, pids=tuple(pids))  # reap.py's one rule: SIGTERM, its grace, SIGKILL


def down(name: str = "amsp", *, runner: Runner = run_command,
         log: Callable[[str], None] = lambda s: None) -> list[str]:
    """Remove lab ``name`` (state file + prefix scan). Idempotent; returns what was removed."""
    preflight()
    if not NAME_RE.match(name):
        raise LabError(f"name must match amsp[a-z0-9]{{0,6}}, got {name!r}")
    pattern = lab_namespace_re(name)  # the prefix scan also finds a lab whose state a crash cut
    targets = sorted(n for n in list_namespaces(runner) if pattern.match(n))
    removed: list[str] = []
    for ns in targets:
        if not ns.endswith("-fab"):
            _stop_processes(ns, runner, log)
    errors = []
    for argv in down_commands(targets):
        proc = runner(argv)
        if proc.returncode == 0:
            removed.append(f"netns {argv[-1]}")
        else:
            errors.append(_explain(argv, proc))
    for ifname in [i for i in host_interfaces(runner) if i.startswith(f"{name}-")]:
        proc = runner(["ip", "link", "del", ifname])
        if proc.returncode == 0:
            removed.append(f"link {ifname}")
        else:
            errors.append(_explain(["ip", "link", "del", ifname], proc))
    if errors:
        raise LabError(f"cluster down: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    if state_path(name).exists():
        state_path(name).unlink()
        removed.append(f"state {state_path(name)}")
        try:
            state_dir().rmdir()  # only if no other lab is recorded there
        except OSError:
            pass
    return removed
