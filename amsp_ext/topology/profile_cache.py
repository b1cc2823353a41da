"""Which cluster a job runs on (its fingerprint) and the measured profiles cached per cluster.

``auto`` with the profile ``cluster`` (planner/defaults.py CLUSTER_PROFILE) plans with a profile
of the cluster it runs on: a cached one whose fingerprint matches, else one measured in the job
(runtime/measure/cluster.py) and saved here. No torch: a launcher that has no process group
(``amsp train`` before it starts its ranks) computes the same fingerprint from the same facts.

[Note: the cluster fingerprint]
A profile describes a set of links; the fingerprint names what decides them and can be read on
every node: the world size, ranks per node, the backend, the device kind, the nodes' identities
(``NCCL_HOSTID`` where set, else the host name; sorted, distinct), and the link rates the system
reports (``/sys/class/net/<iface>/speed`` of every non-loopback interface that reports one, and
``/sys/class/infiniband/<dev>/ports/<p>/rate``), per node. On the one-machine lab (``amsp
cluster``) the nodes are network namespaces whose links are shaped with ``tc``: the veth
interfaces report their nominal speed whatever the shaping, so there the lab's own link settings
(``AMSP_CLUSTER_LINK``: rate, latency) replace the interface speeds, and a 100 Mbit lab never
matches a 1 Gbit one. Limitation: a link slowed by something the system does not report (a
``tc`` limit outside the lab, a congested switch, another job's traffic) keeps its fingerprint;
the maximum age below bounds how long such a change goes unmeasured.

[Note: the cache]
``$XDG_CACHE_HOME/amsp_ext/profiles/`` (else ``~/.cache/amsp_ext/profiles/``; ``$AMSP_PROFILE_CACHE``
when set, e.g. a directory the nodes share, or the test suite's own) holds one
amsp-profile/1 JSON per fingerprint, named by the fingerprint's hash, with the fingerprint and the
measuring time in its metadata: a file ``amsp plan --profile`` reads as it is. JSON only (nothing
executable, nothing unpickled). A file is trusted only when it parses as a profile, its
fingerprint equals the job's field by field and it is younger than MAX_AGE_S; otherwise the job
measures again and says why in one line. Seven days: long enough that a cluster used daily
measures about once a week (a few seconds to a minute, runtime/measure/cluster.py [Note: the
cost of measuring]), short enough that a changed network (a driver, a switch, a cable) that the
fingerprint cannot see is re-measured within a week.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MAX_AGE_S", "CacheLookup", "ClusterFingerprint", "ProfileSource", "cache_dir", "cpu_memory_per_rank",
           "host_facts", "lookup", "named_source", "merge_facts", "store"]

MAX_AGE_S = 7 * 24 * 3600
CACHE_SCHEMA_KEY = "cluster_fingerprint"  # metadata key of a cached profile


def host_facts(environ: Mapping[str, str] | None = None, sys_root: str = "/sys") -> dict[str, Any]:
    """What this process can see of its node: ``{"node": id, "links": [..], "lab": str|None}``."""
    env = os.environ if environ is None else environ
    node = env.get("NCCL_HOSTID") or socket.gethostname()
    lab = env.get("AMSP_CLUSTER_LINK") or None
    links = [] if lab else _link_rates(Path(sys_root))  # [Note: the cluster fingerprint]
    return {"node": node, "links": links, "lab": lab}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # e.g. speed of a down interface: EINVAL
        return None


def _link_rates(root: Path) -> list[str]:
    out = []
    for dev in sorted((root / "class" / "net").glob("*")):
        speed = _read(dev / "speed")
        if dev.name != "lo" and speed and speed.lstrip("-").isdigit() and int(speed) > 0:
            out.append(f"{dev.name}:{int(speed)}Mb/s")
    for port in sorted((root / "class" / "infiniband").glob("*/ports/*")):
        rate = _read(port / "rate")
        if rate:
            out.append(f"{port.parent.parent.name}/{port.name}:{rate}")
    return out


@dataclass(frozen=True, kw_only=True)
class ClusterFingerprint:
    """[Note: the cluster fingerprint]"""

    world_size: int
    ranks_per_node: int
    backend: str
    device: str
    nodes: tuple[str, ...]  # sorted, distinct
    links: tuple[str, ...]  # "<node> <iface>:<rate>", sorted, distinct
    lab: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "backend": self.backend, "device": self.device, "nodes": list(self.nodes),
                "links": list(self.links), "lab": self.lab}

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        nodes = ",".join(self.nodes[:4]) + (f",... ({len(self.nodes)})" if len(self.nodes) > 4 else "")
        link = f"lab {self.lab}" if self.lab else (", ".join(self.links[:4]) or "link rates not reported")
        return (f"{self.key}: {self.world_size} ranks, {self.ranks_per_node} per node, {self.backend}, "
                f"{self.device}, nodes {nodes}, {link}")


def merge_facts(facts: list[Mapping[str, Any]], *, ranks_per_node: int, backend: str,
                device: str) -> ClusterFingerprint:
    """The fingerprint of a job whose ranks report ``facts`` (host_facts, one per rank)."""
    return ClusterFingerprint(
        world_size=len(facts), ranks_per_node=ranks_per_node, backend=backend, device=device,
        nodes=tuple(sorted({f["node"] for f in facts})),
        links=tuple(sorted({f"{f['node']} {link}" for f in facts for link in f["links"]})),
        lab=" | ".join(sorted({f["lab"] for f in facts if f["lab"]})) or None)


CACHE_ENV = "AMSP_PROFILE_CACHE"  # a directory used instead (a shared one, or a test's own)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "amsp_ext" / "profiles"


@dataclass(frozen=True, kw_only=True)
class CacheLookup:
    """A cache entry that may be used (``doc`` set) or why it may not (``why``; empty: none)."""

    path: Path
    doc: dict[str, Any] | None = None
    age_s: float = 0.0
    why: str = ""


def lookup(fingerprint: ClusterFingerprint, *, directory: Path | None = None,
           now: float | None = None) -> CacheLookup:
    """The cached profile of ``fingerprint``, checked as [Note: the cache] says."""
    from amsp_ext.planner.profile import BandwidthProfile

    path = (directory or cache_dir()) / f"{fingerprint.key}.json"
    if not path.exists():
        return CacheLookup(path=path)
    try:
        doc = json.loads(path.read_text())
        BandwidthProfile.from_dict(doc, source=str(path))
        meta = doc["metadata"]
        stored, measured_at = meta.get(CACHE_SCHEMA_KEY), meta.get("measured_at")
        if not isinstance(stored, dict):
            raise ValueError(f"metadata.{CACHE_SCHEMA_KEY} must be an object, got {type(stored).__name__}")
        if stored != fingerprint.as_dict():
            diff = sorted(k for k in set(stored) | set(fingerprint.as_dict())
                          if stored.get(k) != fingerprint.as_dict().get(k))
            raise ValueError(f"its fingerprint differs from this cluster's in {', '.join(diff)}")
        if isinstance(measured_at, bool) or not isinstance(measured_at, (int, float)):
            raise ValueError(f"metadata.measured_at must be a number of seconds, got {measured_at!r}")
    except (ValueError, OSError) as e:  # json.JSONDecodeError and ProfileError are ValueErrors
        return CacheLookup(path=path, why=f"cached profile {path} not used: {str(e).splitlines()[0]}")
    age = (time.time() if now is None else now) - measured_at
    if age > MAX_AGE_S or age < 0:
        return CacheLookup(path=path, why=f"cached profile {path} not used: measured {format_age(age)} "
                                          f"ago, the limit is {format_age(MAX_AGE_S)}")
    return CacheLookup(path=path, doc=doc, age_s=age)


def store(doc: dict[str, Any], fingerprint: ClusterFingerprint, *, directory: Path | None = None,
          now: float | None = None) -> Path:
    """Write ``doc`` (an amsp-profile/1 document) as ``fingerprint``'s entry; returns its path.
    Written to a temporary name and renamed, so a reader never sees half a file."""
    doc = dict(doc, metadata={**doc["metadata"], CACHE_SCHEMA_KEY: fingerprint.as_dict(),
                              "measured_at": time.time() if now is None else now})
    path = (directory or cache_dir()) / f"{fingerprint.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def cpu_memory_per_rank(ranks_per_node: int) -> int:
    """A CPU rank's share of this host's RAM: what plan "auto", ``amsp train``'s launcher and
    ``amsp tune`` give the planner as the memory per rank where no device says it."""
    import psutil

    return psutil.virtual_memory().total // ranks_per_node


def format_age(seconds: float) -> str:
    s = abs(seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{'-' if seconds < 0 else ''}{s / n:.1f} {unit}"
    return f"{seconds:.0f} s"


@dataclass(frozen=True, kw_only=True)
class ProfileSource:
    """Where the profile a job planned with came from: the start line and ``"profile"`` of
    ``amsp train --json``: which cluster planned the job."""

    source: str  # "measured" | "cache" | "bundled" | "file"
    path: str | None
    fingerprint: ClusterFingerprint | None = None
    age_s: float | None = None  # cache: the entry's age
    seconds: float | None = None  # measured: how long measuring took
    describes: str = ""  # bundled or file: the cluster its metadata names

    def line(self) -> str:
        where = {"measured": f"measured now in {self.seconds or 0:.1f} s, saved to {self.path}",
                 "cache": f"cache {self.path}, {format_age(self.age_s or 0)} old",
                 "bundled": f"bundled {self.path}", "file": f"file {self.path}"}[self.source]
        of = (f"; cluster {self.fingerprint.describe()}" if self.fingerprint is not None
              else f"; describes {self.describes or 'a cluster its metadata does not name'}")
        return f"amsp: profile {where}{of}"

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "path": self.path,
                "fingerprint": self.fingerprint.as_dict() if self.fingerprint else None,
                "fingerprint_key": self.fingerprint.key if self.fingerprint else None,
                "age_s": self.age_s, "seconds": self.seconds, "describes": self.describes or None}


def named_source(name_or_path: str, metadata: Mapping[str, Any]) -> ProfileSource:
    """The ProfileSource of a profile asked for by name (bundled) or path (file)."""
    from amsp_ext.planner.profile import bundled_profiles

    world, link = metadata.get("world") or {}, metadata.get("link") or {}
    describes = ", ".join(x for x in (
        f"{world.get('nodes')} nodes x {world.get('gpus_per_node')} GPUs" if world else "",
        f"intra {link.get('intra')}" if link.get("intra") else "",
        f"inter {link.get('inter')}" if link.get("inter") else "") if x)
    bundled = str(name_or_path) in bundled_profiles()
    return ProfileSource(source="bundled" if bundled else "file", path=str(name_or_path), describes=describes)
