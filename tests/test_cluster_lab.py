"""The lab's pure logic (names, addresses, commands, launch lines) and its up/down bookkeeping,
without root: commands go to a fake runner that models `ip netns`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from amsp_ext.cluster import netns
from amsp_ext.cluster.lab import (
    IFNAME_MAX,
    Lab,
    LabError,
    LabSpec,
    down_commands,
    parse_duration_us,
    parse_rate,
    up_commands,
)
from amsp_ext.cluster.launch import node_launches, torchrun_program

REPO = Path(__file__).resolve().parents[1]


def spec(**kw) -> LabSpec:
    base = dict(num_nodes=2, gpus_per_node=2, inter_node_bandwidth="1gbit")
    base.update(kw)
    return LabSpec(**base)


# -- parsing and validation ----------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [
    ("1gbit", 1_000_000_000), ("500mbit", 500_000_000), ("2.5gbit", 2_500_000_000),
    ("100kbit", 100_000), ("1gbps", 8_000_000_000), ("10mbps", 80_000_000), ("64000bit", 64_000),
])
def test_parse_rate_tc_units(text, bits):
    assert parse_rate(text, "inter_node_bandwidth") == bits


@pytest.mark.parametrize("text", ["1 gigabit", "fast", "", "1g", "100bit"])
def test_parse_rate_rejects_with_field_name(text):
    with pytest.raises(LabError, match="inter_node_bandwidth") as e:
        parse_rate(text, "inter_node_bandwidth")
    assert "\n" not in str(e.value)


def test_parse_duration():
    assert parse_duration_us("0.2ms", "latency") == pytest.approx(200.0)
    assert parse_duration_us("50us", "latency") == 50.0
    with pytest.raises(LabError, match="latency"):
        parse_duration_us("0.2", "latency")


@pytest.mark.parametrize("kw,field", [
    (dict(name="lab"), "name"),
    (dict(name="amsp-x"), "name"),
    (dict(name="amsptoolong1"), "name"),
    (dict(num_nodes=0), "num_nodes"),
    (dict(gpus_per_node=0), "gpus_per_node"),
    (dict(nodes_per_leaf=1), "spine_bandwidth"),
    (dict(spine_bandwidth="1gbit"), "nodes_per_leaf"),
    (dict(nodes_per_leaf=3, spine_bandwidth="1gbit"), "nodes_per_leaf"),
    (dict(subnet="8.8.8.0/24"), "private"),
    (dict(subnet="10.77.0.0/30", num_nodes=3), "too few"),
    (dict(inter_node_bandwidth="1Gb"), "inter_node_bandwidth"),
])
def test_spec_rejects_bad_fields(kw, field):
    with pytest.raises(LabError, match=field) as e:
        spec(**kw)
    assert "\n" not in str(e.value)


# -- names and addresses ---------------------------------------------------------------------------

def test_names_addresses_hand_worked():
    lab = Lab(spec=spec(num_nodes=3))
    assert lab.namespaces() == ["amsp-fab", "amsp-n0", "amsp-n1", "amsp-n2"]
    assert lab.node_ifname == "amsp-eth0"
    assert [lab.node_address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert lab.master_address == "10.77.0.1"


def test_every_name_has_prefix_and_fits_ifnamsiz():
    lab = Lab(spec=spec(name="amspabcdef", num_nodes=64, nodes_per_leaf=4, spine_bandwidth="10gbit"))
    names = lab.interfaces() + lab.namespaces()
    assert all(n.startswith("amspabcdef-") for n in names)
    assert max(len(n) for n in lab.interfaces()) <= IFNAME_MAX
    up_commands(lab)  # validates too


def test_up_commands_touch_only_lab_namespaces():
    lab = Lab(spec=spec(num_nodes=4, nodes_per_leaf=2, spine_bandwidth="500mbit"))
    mine = set(lab.namespaces())
    for argv in up_commands(lab):
        if argv[:3] == ["ip", "netns", "add"]:
            assert argv[3] in mine
        else:
            assert argv[0] in ("ip", "tc") and argv[1] == "-n" and argv[2] in mine, argv
        if "netns" in argv[3:]:  # veth peer moved into a namespace: must be one of ours
            assert argv[argv.index("netns", 3) + 1] in mine


def test_up_commands_shape_each_direction_and_the_spine():
    lab = Lab(spec=spec(num_nodes=4, nodes_per_leaf=2, spine_bandwidth="500mbit"))
    cmds = up_commands(lab)
    tbf = {(c[2], c[6]): c[c.index("rate") + 1] for c in cmds if c[0] == "tc" and "tbf" in c}
    want = {}
    for i in range(4):
        want[(f"amsp-n{i}", "amsp-eth0")] = "1000000000bit"  # node i sends
        want[("amsp-fab", f"amsp-v{i}")] = "1000000000bit"  # node i receives
    for j in range(2):
        want[("amsp-fab", f"amsp-u{j}")] = "500000000bit"
        want[("amsp-fab", f"amsp-d{j}")] = "500000000bit"
    assert tbf == want
    masters = {c[5]: c[7] for c in cmds if c[3:5] == ["link", "set"] and "master" in c}
    assert masters == {"amsp-v0": "amsp-l0", "amsp-v1": "amsp-l0", "amsp-v2": "amsp-l1",
                       "amsp-v3": "amsp-l1", "amsp-u0": "amsp-l0", "amsp-u1": "amsp-l1",
                       "amsp-d0": "amsp-sp", "amsp-d1": "amsp-sp"}
    addrs = [c[5] for c in cmds if c[3:5] == ["addr", "add"]]
    assert addrs == ["10.77.0.1/24", "10.77.0.2/24", "10.77.0.3/24", "10.77.0.4/24"]


def test_latency_is_split_over_the_two_shaped_hops():
    cmds = up_commands(Lab(spec=spec(latency="0.2ms")))
    delays = [c[c.index("delay") + 1] for c in cmds if "netem" in c]
    assert delays == ["100us"] * 4  # 2 nodes x (send, receive); a path crosses two hops


def test_down_deletes_nodes_then_fabric():
    assert down_commands(["amsp-fab", "amsp-n1", "amsp-n0"]) == [
        ["ip", "netns", "del", "amsp-n0"], ["ip", "netns", "del", "amsp-n1"],
        ["ip", "netns", "del", "amsp-fab"]]


def test_link_settings_for_profile_metadata():
    link = Lab(spec=spec(nodes_per_leaf=1, spine_bandwidth="500mbit")).link_settings()
    assert link["inter_node_bandwidth_bits"] == 10**9 and link["spine_bandwidth_bits"] == 5 * 10**8
    assert link["nodes_per_leaf"] == 1 and "intra" in link and "inter" in link


# -- cluster run ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd,want", [
    (["train.py", "--x"], ["train.py", "--x"]),
    (["-m", "amsp_ext.cli", "profile"], ["-m", "amsp_ext.cli", "profile"]),
    (["python3", "-m", "mod"], ["-m", "mod"]),
    (["amsp", "profile", "--quick"], ["--no-python", "amsp", "profile", "--quick"]),
])
def test_torchrun_program(cmd, want):
    assert torchrun_program(cmd) == want


def test_torchrun_program_needs_a_command():
    with pytest.raises(LabError, match="after '--'"):
        torchrun_program([])


def test_node_launch_lines():
    launches = node_launches(spec(), ["-m", "x"], master_port=29511, state_file="/s.json",
                             log_dir="/logs", python="/py")
    assert len(launches) == 2
    for i, launch in enumerate(launches):
        assert launch.argv[:5] == ["ip", "netns", "exec", f"amsp-n{i}", "/py"]
        for flag in ("--nnodes=2", "--nproc-per-node=2", f"--node-rank={i}",
                     "--master-addr=10.77.0.1", "--master-port=29511"):
            assert flag in launch.argv
        assert launch.argv[-2:] == ["-m", "x"]
        assert launch.env["GLOO_SOCKET_IFNAME"] == launch.env["NCCL_SOCKET_IFNAME"] == "amsp-eth0"
        assert launch.env["NCCL_HOSTID"] == f"amsp-n{i}"  # NCCL must see two hosts
        assert json.loads(launch.env["AMSP_CLUSTER_LINK"])["inter_node_bandwidth_bits"] == 10**9


# -- up / down bookkeeping against a fake `ip` ------------------------------------------------------

class FakeIp:
    """Models `ip netns add/del/list` and lets one command fail."""

    def __init__(self, fail_on: str | None = None, namespaces=()):
        self.namespaces = set(namespaces)
        self.fail_on = fail_on
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        ok = lambda out="": subprocess.CompletedProcess(argv, 0, out, "")  # noqa: E731
        if self.fail_on and self.fail_on in " ".join(argv):
            return subprocess.CompletedProcess(argv, 2, "", "Error: Specified qdisc kind is unknown.\n")
        if argv[:3] == ["ip", "netns", "add"]:
            self.namespaces.add(argv[3])
        elif argv[:3] == ["ip", "netns", "del"]:
            self.namespaces.discard(argv[3])
        elif argv[:3] == ["ip", "netns", "list"]:
            return ok("".join(f"{n} (id: 1)\n" for n in sorted(self.namespaces)) + "other-ns\n")
        elif argv[:3] == ["ip", "-o", "link"]:
            return ok("1: lo: <LOOPBACK> mtu 65536\n2: eth0@if5: <UP> mtu 1500\n")
        elif argv[:4] == ["ip", "-o", "-4", "addr"]:
            return ok("2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\n")
        return ok()


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(netns.STATE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(netns, "preflight", lambda: None)
    return tmp_path


def test_up_then_down_with_fake_ip(state_dir):
    ip = FakeIp()
    state = netns.up(spec(), runner=ip)
    assert state["status"] == "up" and ip.namespaces == {"amsp-fab", "amsp-n0", "amsp-n1"}
    assert json.loads((state_dir / "amsp.json").read_text())["nodes"][1]["address"] == "10.77.0.2"
    with pytest.raises(LabError, match="already up"):
        netns.up(spec(), runner=ip)
    removed = netns.down("amsp", runner=ip)
    assert ip.namespaces == set() and not (state_dir / "amsp.json").exists()
    assert "netns amsp-fab" in removed
    assert netns.down("amsp", runner=ip) == []  # idempotent


def test_failed_up_rolls_back_with_one_line_error(state_dir):
    ip = FakeIp(fail_on="netem")
    with pytest.raises(LabError) as e:
        netns.up(spec(latency="1ms"), runner=ip)
    msg = str(e.value)
    assert "\n" not in msg and "netem" in msg and "rolled back" in msg
    assert ip.namespaces == set() and not (state_dir / "amsp.json").exists()


def test_down_clears_crash_leftovers_without_state(state_dir):
    ip = FakeIp(namespaces={"amsp-n0", "amsp-fab", "amspx-n0", "amsp-n0x", "amsp"})
    with pytest.raises(LabError, match="leftovers"):
        netns.up(spec(), runner=ip)
    netns.down("amsp", runner=ip)
    # only the exact lab names go: another lab's and look-alike names stay
    assert ip.namespaces == {"amspx-n0", "amsp-n0x", "amsp"}


def test_subnet_clash_with_host_is_refused(state_dir):
    with pytest.raises(LabError, match="overlaps"):
        netns.up(spec(subnet="192.0.2.0/24"), runner=FakeIp())


def test_preflight_messages(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda t: None)
    with pytest.raises(LabError, match="apt-get install -y iproute2"):
        netns.preflight()
    monkeypatch.setattr(netns.shutil, "which", lambda t: f"/usr/sbin/{t}")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root") as e:
        netns.preflight()
    assert "\n" not in str(e.value)


# -- CLI --------------------------------------------------------------------------------------------

def test_cli_config_file_and_flag_override():
    from amsp_ext.cli.main import build_parser
    from amsp_ext.cli.cluster import spec_from_args

    args = build_parser().parse_args(
        ["cluster", "up", "--config", str(REPO / "configs/clusters/lab-2x2.yaml"), "--inter-node-bandwidth", "500mbit"])
    assert spec_from_args(args) == LabSpec(num_nodes=2, gpus_per_node=2, inter_node_bandwidth="500mbit",
                                           name="amsp", subnet="10.77.0.0/24")


def test_cli_one_line_error(capsys, monkeypatch):
    from amsp_ext.cli.main import main

    assert main(["cluster", "up", "--nodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("amsp cluster: error:") and "--gpus-per-node" in err and "\n" not in err


def test_set_changes_every_node_link_both_ways_and_the_state(state_dir):
    ip = FakeIp()
    netns.up(spec(latency="1ms"), runner=ip)
    ip.calls.clear()
    state = netns.set_bandwidth("amsp", "50mbit", runner=ip)
    # hand-worked: 2 nodes x (node side, fabric side), tbf changed in place, netem untouched;
    # burst = max(32 KiB, 50e6 / 8 / 1000 = 6250 B) = 32768
    tail = ["root", "handle", "1:", "tbf", "rate", "50000000bit", "burst", "32768", "latency", "50ms"]
    assert ip.calls == [
        ["tc", "-n", "amsp-n0", "qdisc", "change", "dev", "amsp-eth0", *tail],
        ["tc", "-n", "amsp-fab", "qdisc", "change", "dev", "amsp-v0", *tail],
        ["tc", "-n", "amsp-n1", "qdisc", "change", "dev", "amsp-eth0", *tail],
        ["tc", "-n", "amsp-fab", "qdisc", "change", "dev", "amsp-v1", *tail],
    ]
    saved = json.loads((state_dir / "amsp.json").read_text())
    assert saved["spec"]["inter_node_bandwidth"] == "50mbit" == state["spec"]["inter_node_bandwidth"]
    assert saved["link"]["inter_node_bandwidth_bits"] == 50_000_000
    netns.down("amsp", runner=ip)


@pytest.mark.parametrize("name,rate,msg", [
    ("nolab", "50mbit", "lab 'nolab' is not up"),
    ("amsp", "fast", "--inter-node-bandwidth: cannot read 'fast'"),
    ("amsp", "1kbit", "below 8kbit"),
])
def test_set_one_line_errors(state_dir, name, rate, msg):
    ip = FakeIp()
    netns.up(spec(), runner=ip)
    with pytest.raises(LabError) as e:
        netns.set_bandwidth(name, rate, runner=ip)
    assert msg in str(e.value) and "\n" not in str(e.value)
    netns.down("amsp", runner=ip)
