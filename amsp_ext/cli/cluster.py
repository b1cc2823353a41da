"""``amsp cluster up|run|set|down|status``: a multi-node lab on one machine (root, iproute2)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from amsp_ext.cluster.launch import JOB_TIMEOUT_S

HELP = "multi-node lab on one machine: network namespaces joined by rate-limited links"

_SPEC_FLAGS = {  # CLI dest -> LabSpec field
    "nodes": "num_nodes",
    "gpus_per_node": "gpus_per_node",
    "inter_node_bandwidth": "inter_node_bandwidth",
    "latency": "latency",
    "nodes_per_leaf": "nodes_per_leaf",
    "spine_bandwidth": "spine_bandwidth",
    "name": "name",
    "subnet": "subnet",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="create the lab (one namespace per node, bridge, tc limits)")
    up.add_argument("--config", help="YAML/JSON file with the fields below (flags override it), "
                                     "e.g. configs/clusters/lab-2x2.yaml")
    up.add_argument("--nodes", type=int, help="number of nodes (namespaces)")
    up.add_argument("--gpus-per-node", type=int, help="ranks per node (torchrun --nproc-per-node)")
    up.add_argument("--inter-node-bandwidth", help="each node link, each direction, tc units: 1gbit, 500mbit")
    up.add_argument("--latency", help="one-way node-to-node latency, e.g. 0.2ms (needs the netem qdisc)")
    up.add_argument("--nodes-per-leaf", type=int, help="nodes under one leaf switch (enables a spine)")
    up.add_argument("--spine-bandwidth", help="each leaf's uplink to the spine, e.g. 500mbit")
    up.add_argument("--subnet", help="private /24 used only inside the lab (default 10.77.0.0/24)")
    up.add_argument("--name", help="lab name and prefix of everything it creates (default amsp)")

    run = sub.add_parser("run", help="run one torchrun per node: amsp cluster run -- <command>")
    run.add_argument("--name", default="amsp")
    run.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S,
                     help="seconds for the whole job (default %(default)g)")
    run.add_argument("--master-port", type=int, default=29500,
                     help="rendezvous port on node 0 (0: a free one, picked inside node 0's namespace)")
    run.add_argument("--log-dir", help="where torchrun keeps per-rank logs (default: a new temp dir)")
    run.add_argument("command", nargs=argparse.REMAINDER,
                     help="script.py args | -m module args | executable args")

    down = sub.add_parser("down", help="remove everything `up` created (idempotent, clears crash leftovers)")
    down.add_argument("--name", default="amsp")

    set_ = sub.add_parser("set", help="change a running lab's links (e.g. degrade them mid-run)")
    set_.add_argument("--name", default="amsp")
    set_.add_argument("--inter-node-bandwidth", required=True,
                      help="new rate of each node link, each direction, tc units: 50mbit, 1gbit")

    status = sub.add_parser("status", help="show the lab's settings and what exists")
    status.add_argument("--name", default="amsp")


def _load_config(path: str) -> dict:
    from amsp_ext.cluster.lab import LabError

    p = Path(path)
    if not p.exists():
        raise LabError(f"--config: no such file {path}")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise LabError(f"--config: {path} must hold a mapping of lab fields")
    data = data.get("cluster", data)
    return data


def spec_from_args(args: argparse.Namespace):
    from amsp_ext.cluster.lab import LabError, LabSpec

    fields: dict = {}
    if args.config:
        fields.update(_load_config(args.config))
    for flag, field in _SPEC_FLAGS.items():
        v = getattr(args, flag, None)
        if v is not None:
            fields[field] = v
    missing = [f"--{k.replace('_', '-')}" for k, f in _SPEC_FLAGS.items()
               if f in ("num_nodes", "gpus_per_node", "inter_node_bandwidth") and f not in fields]
    if missing:
        raise LabError(f"cluster up: missing {', '.join(missing)} (or give them in --config)")
    return LabSpec.from_dict(fields)


def run(args: argparse.Namespace) -> int:
    from amsp_ext.cluster import netns
    from amsp_ext.cluster.lab import LabError, LabSpec

    say = lambda s: print(f"amsp cluster: {s}", file=sys.stderr)  # noqa: E731
    if args.action == "up":
        spec = spec_from_args(args)
        state = netns.up(spec, log=say)
        for node in state["nodes"]:
            print(f"node{node['node']}: netns {node['namespace']}  {node['address']} on {node['ifname']}"
                  f"  leaf {node['leaf']}")
        print(f"next: amsp cluster run --name {spec.name} -- -m amsp_ext.cli profile --quick")
        return 0
    if args.action == "down":
        removed = netns.down(args.name, log=say)
        print("removed: " + (", ".join(removed) if removed else f"nothing (lab {args.name!r} was not up)"))
        return 0
    if args.action == "set":
        state = netns.set_bandwidth(args.name, args.inter_node_bandwidth, log=say)
        print(f"lab {args.name}: {state['link']['inter']}")
        return 0
    if args.action == "status":
        netns.preflight()
        state = netns.load_state(args.name)
        found_ns, found_if = netns.find_leftovers(args.name)
        if state is None and not found_ns and not found_if:
            print(f"lab {args.name!r}: down")
            return 0
        print(json.dumps({"state": state, "namespaces": found_ns, "host_interfaces": found_if}, indent=2))
        return 0
    if args.action == "run":
        from amsp_ext.cluster.launch import run_on_lab

        netns.preflight()
        state = netns.load_state(args.name)
        if state is None or state.get("status") != "up":
            raise LabError(f"cluster run: lab {args.name!r} is not up; start it with `amsp cluster up ...`")
        command = list(args.command)
        if command and command[0] == "--":
            command = command[1:]
        spec = LabSpec.from_dict(state["spec"])
        return run_on_lab(spec, command, state_file=str(netns.state_path(args.name)),
                          master_port=args.master_port, timeout_s=args.timeout, log_dir=args.log_dir)
    raise LabError(f"cluster: unknown action {args.action!r}; use up, run, set, down or status")
