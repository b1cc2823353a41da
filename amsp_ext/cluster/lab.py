"""A multi-node lab on one machine: names, address plan and the exact `ip`/`tc` commands.

Pure Python (no subprocess, no root): everything here is a function of a :class:`LabSpec`, so it
is unit-tested without privileges. :mod:`amsp_ext.cluster.netns` executes the command lists.

[Note: lab layout]
Every object lives inside network namespaces the lab creates; the host's own network namespace is
never touched (no interface, address, route or qdisc is added to it)::

    <name>-fab   the "fabric": one bridge per leaf switch (<name>-l0, <name>-l1, ...), plus a
                 spine bridge <name>-sp when leaf groups are asked for
    <name>-n<i>  node i: loopback + one interface <name>-eth0, a veth whose peer <name>-v<i>
                 sits in the fabric on node i's leaf bridge

Ranks of one node talk over loopback (their own address is local to the namespace), so they are
fast; ranks of two nodes go through both ends of the veth links, which are rate-limited. With
leaf groups, each leaf bridge reaches the spine bridge over one more veth pair
(<name>-u<j> on leaf j, <name>-d<j> on the spine), rate-limited with the spine bandwidth, so
nodes under different leaves share that link.

[Note: why shape both ends of a link]
`tc` shapes egress only. A NIC limits both directions, so a node's link is shaped at the node's
interface (what the node sends) and at its fabric-side peer (what it receives). Leaving one
direction unshaped lets an all-gather's receive side run at memory speed, which no real NIC does.
``--latency`` is the one-way node-to-node latency; a path crosses two shaped egresses, so each
end adds half of it (netem under tbf).

[Note: names]
Every namespace and interface name starts with ``<name>-`` and ``<name>`` must match
``amsp[a-z0-9]{0,6}``, so ``down`` can find crash leftovers by prefix and can never match an
object the lab did not create. Linux caps interface names at 15 characters; the longest one made
here is ``<name>-eth0`` (at most 15 with a 10-character name) or ``<name>-v<node>`` / ``-u<leaf>``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass

__all__ = [
    "IFNAME_MAX",
    "LabError",
    "LabSpec",
    "Lab",
    "down_commands",
    "parse_rate",
    "set_rate_commands",
    "parse_duration_us",
    "up_commands",
]

IFNAME_MAX = 15  # IFNAMSIZ - 1
NAME_RE = re.compile(r"^amsp[a-z0-9]{0,6}$")
MAX_NODES = 64
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)\s*$", re.I)
# tc's units: "...bit" is bits per second, "...bps" is BYTES per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.I)
_DUR_US = {"us": 1, "ms": 1e3, "s": 1e6}


class LabError(ValueError):
    """Bad lab spec or a lab command that failed; the message is one line."""


def parse_rate(text: str, field: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 bits/s (tc units; ``mbps`` is megaBYTES per second)."""
    m = _RATE_RE.match(str(text))
    if not m:
        raise LabError(
            f"{field}: cannot read {text!r}; use a number with a tc unit: "
            f"bit, kbit, mbit, gbit (bits/s) or bps, kbps, mbps, gbps (bytes/s), e.g. '1gbit'"
        )
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if bits < 8e3:
        raise LabError(f"{field}: {text!r} is below 8kbit; use a rate of at least 8kbit")
    return int(bits)


def parse_duration_us(text: str, field: str) -> float:
    """``"0.2ms"`` -> 200.0 microseconds."""
    m = _DUR_RE.match(str(text))
    if not m:
        raise LabError(f"{field}: cannot read {text!r}; use a number with us, ms or s, e.g. '0.2ms'")
    return float(m.group(1)) * _DUR_US[m.group(2).lower()]


def format_rate(bits: int) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // int(scale)}{unit}"
    return f"{bits}bit"


@dataclass(frozen=True, kw_only=True)
class LabSpec:
    """What ``amsp cluster up`` builds. Rates use tc units (``1gbit``), latency ``0.2ms``."""

    num_nodes: int
    gpus_per_node: int  # ranks per node: torchrun's --nproc-per-node
    inter_node_bandwidth: str
    latency: str | None = None
    nodes_per_leaf: int | None = None
    spine_bandwidth: str | None = None
    name: str = "amsp"
    subnet: str = "10.77.0.0/24"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise LabError(
                f"name must match amsp[a-z0-9]{{0,6}} (project prefix, short enough for "
                f"15-character interface names), got {self.name!r}"
            )
        for field_name, lo, hi in (("num_nodes", 1, MAX_NODES), ("gpus_per_node", 1, 64)):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise LabError(f"{field_name} must be an integer in {lo}..{hi}, got {v!r}")
        parse_rate(self.inter_node_bandwidth, "inter_node_bandwidth")
        if self.latency is not None:
            parse_duration_us(self.latency, "latency")
        if (self.nodes_per_leaf is None) != (self.spine_bandwidth is None):
            raise LabError(
                "nodes_per_leaf and spine_bandwidth go together: give both (leaf groups joined "
                "by a rate-limited spine) or neither (one flat switch)"
            )
        if self.nodes_per_leaf is not None:
            k = self.nodes_per_leaf
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.num_nodes:
                raise LabError(f"nodes_per_leaf must be an integer in 1..{self.num_nodes}, got {k!r}")
            parse_rate(self.spine_bandwidth, "spine_bandwidth")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as e:
            raise LabError(f"subnet must be an IPv4 network like '10.77.0.0/24', got {self.subnet!r} ({e})")
        if not net.is_private:
            raise LabError(f"subnet must be a private range (10/8, 172.16/12, 192.168/16), got {self.subnet}")
        if net.num_addresses - 2 < self.num_nodes:
            raise LabError(f"subnet {self.subnet} has too few addresses for {self.num_nodes} nodes")

    # -- derived numbers ----------------------------------------------------------------------
    @property
    def inter_node_bits(self) -> int:
        return parse_rate(self.inter_node_bandwidth, "inter_node_bandwidth")

    @property
    def spine_bits(self) -> int | None:
        return None if self.spine_bandwidth is None else parse_rate(self.spine_bandwidth, "spine_bandwidth")

    @property
    def latency_us(self) -> float | None:
        return None if self.latency is None else parse_duration_us(self.latency, "latency")

    @property
    def num_leaves(self) -> int:
        if self.nodes_per_leaf is None:
            return 1
        return -(-self.num_nodes // self.nodes_per_leaf)

    def leaf_of(self, node: int) -> int:
        return 0 if self.nodes_per_leaf is None else node // self.nodes_per_leaf

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LabSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LabError(f"unknown lab field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class Lab:
    """Names and addresses of one lab; all derived from its spec."""

    spec: LabSpec

    @property
    def prefix(self) -> str:
        return f"{self.spec.name}-"

    @property
    def fabric_ns(self) -> str:
        return f"{self.spec.name}-fab"

    def node_ns(self, node: int) -> str:
        return f"{self.spec.name}-n{node}"

    @property
    def node_ifname(self) -> str:
        """The node's interface, same name in every node namespace (GLOO_SOCKET_IFNAME)."""
        return f"{self.spec.name}-eth0"

    def node_peer(self, node: int) -> str:
        return f"{self.spec.name}-v{node}"

    def leaf_bridge(self, leaf: int) -> str:
        return f"{self.spec.name}-l{leaf}"

    @property
    def spine_bridge(self) -> str:
        return f"{self.spec.name}-sp"

    def uplink(self, leaf: int) -> tuple[str, str]:
        """(leaf-side, spine-side) ends of leaf ``leaf``'s spine link."""
        return f"{self.spec.name}-u{leaf}", f"{self.spec.name}-d{leaf}"

    def namespaces(self) -> list[str]:
        return [self.fabric_ns] + [self.node_ns(i) for i in range(self.spec.num_nodes)]

    def interfaces(self) -> list[str]:
        names = [self.node_ifname] + [self.node_peer(i) for i in range(self.spec.num_nodes)]
        names += [self.leaf_bridge(j) for j in range(self.spec.num_leaves)]
        if self.spec.nodes_per_leaf is not None:
            names.append(self.spine_bridge)
            for j in range(self.spec.num_leaves):
                names += list(self.uplink(j))
        return names

    # -- addresses ----------------------------------------------------------------------------
    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.spec.subnet)

    def node_address(self, node: int) -> str:
        return str(self.network.network_address + 1 + node)

    @property
    def master_address(self) -> str:
        return self.node_address(0)

    def link_settings(self) -> dict:
        """What a profile records as ``metadata.link`` (and what `cluster run` exports)."""
        s = self.spec
        inter = f"tbf {format_rate(s.inter_node_bits)} per node link, each direction"
        if s.latency is not None:
            inter += f", {s.latency} one-way latency (netem)"
        out = {
            "intra": "loopback inside one network namespace (unshaped)",
            "inter": inter,
            "lab": s.name,
            "inter_node_bandwidth_bits": s.inter_node_bits,
        }
        if s.nodes_per_leaf is not None:
            out["spine"] = f"tbf {format_rate(s.spine_bits)} per leaf uplink, each direction"
            out["nodes_per_leaf"] = s.nodes_per_leaf
            out["spine_bandwidth_bits"] = s.spine_bits
        if s.latency is not None:
            out["latency_us"] = s.latency_us
        return out


def validate_names(lab: Lab) -> None:
    for name in lab.interfaces():
        if len(name) > IFNAME_MAX:
            raise LabError(
                f"interface name {name!r} is longer than {IFNAME_MAX} characters; use a shorter "
                f"lab name or fewer nodes"
            )


def _tbf(ns: str, dev: str, bits: int, verb: str) -> list[str]:
    # Burst: 1 ms of traffic, at least 32 KiB (a few MTUs, and above rate/HZ at HZ=1000).
    burst = max(32 * 1024, bits // 8 // 1000)
    return ["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "handle", "1:", "tbf",
            "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


def _shape(ns: str, dev: str, bits: int, latency_us: float | None) -> list[list[str]]:
    """tbf at ``bits``/s on ``dev``'s egress, with netem delay underneath when asked."""
    cmds = [_tbf(ns, dev, bits, "add")]
    if latency_us is not None:
        cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                     "netem", "delay", f"{latency_us / 2:g}us", "limit", "100000"])
    return cmds


def up_commands(lab: Lab) -> list[list[str]]:
    """Every command ``up`` runs, in order. Each one is inside a lab namespace."""
    validate_names(lab)
    s, fab = lab.spec, lab.fabric_ns
    prefixlen = lab.network.prefixlen
    cmds: list[list[str]] = [["ip", "netns", "add", fab], ["ip", "-n", fab, "link", "set", "lo", "up"]]
    for j in range(s.num_leaves):
        br = lab.leaf_bridge(j)
        cmds += [["ip", "-n", fab, "link", "add", br, "type", "bridge"],
                 ["ip", "-n", fab, "link", "set", br, "up"]]
    if s.nodes_per_leaf is not None:
        sp = lab.spine_bridge
        cmds += [["ip", "-n", fab, "link", "add", sp, "type", "bridge"],
                 ["ip", "-n", fab, "link", "set", sp, "up"]]
        for j in range(s.num_leaves):
            up, down = lab.uplink(j)
            cmds += [
                ["ip", "-n", fab, "link", "add", up, "type", "veth", "peer", "name", down],
                ["ip", "-n", fab, "link", "set", up, "master", lab.leaf_bridge(j)],
                ["ip", "-n", fab, "link", "set", down, "master", sp],
                ["ip", "-n", fab, "link", "set", up, "up"],
                ["ip", "-n", fab, "link", "set", down, "up"],
            ]
            cmds += _shape(fab, up, s.spine_bits, None)
            cmds += _shape(fab, down, s.spine_bits, None)
    eth = lab.node_ifname
    for i in range(s.num_nodes):
        ns, peer = lab.node_ns(i), lab.node_peer(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", fab, "link", "add", peer, "type", "veth", "peer", "name", eth, "netns", ns],
            ["ip", "-n", fab, "link", "set", peer, "master", lab.leaf_bridge(s.leaf_of(i))],
            ["ip", "-n", fab, "link", "set", peer, "up"],
            ["ip", "-n", ns, "addr", "add", f"{lab.node_address(i)}/{prefixlen}", "dev", eth],
            ["ip", "-n", ns, "link", "set", eth, "up"],
        ]
        cmds += _shape(ns, eth, s.inter_node_bits, s.latency_us)  # what node i sends
        cmds += _shape(fab, peer, s.inter_node_bits, s.latency_us)  # what node i receives
    return cmds


def set_rate_commands(lab: Lab, bits: int) -> list[list[str]]:
    """``amsp cluster set --inter-node-bandwidth``: ``tc qdisc change`` of every node link's tbf,
    both directions, on a running lab (the netem delay under it, if any, stays). Traffic in
    flight keeps flowing: a job running on the lab sees its links slow down or speed up."""
    cmds = []
    for i in range(lab.spec.num_nodes):
        cmds.append(_tbf(lab.node_ns(i), lab.node_ifname, bits, "change"))  # what node i sends
        cmds.append(_tbf(lab.fabric_ns, lab.node_peer(i), bits, "change"))  # what node i receives
    return cmds


def lab_namespace_re(name: str) -> re.Pattern:
    """Matches exactly the namespace names a lab called ``name`` creates."""
    return re.compile(rf"^{re.escape(name)}-(fab|n\d+)$")


def down_commands(namespaces: list[str]) -> list[list[str]]:
    """Deleting a namespace deletes its interfaces, bridges and qdiscs (a veth pair goes with
    either end), so ``down`` is one command per namespace: nodes first, the fabric last."""
    ordered = sorted(namespaces, key=lambda n: (n.endswith("-fab"), n))
    return [["ip", "netns", "del", ns] for ns in ordered]
