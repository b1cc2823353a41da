"""amsp_ext's imports point one way (docs/DESIGN.md, Layers): no cycle between its modules, no
upward import, and the planner (with the config schema) never imports torch.

Every ``import`` counts, at module level or inside a function or ``if TYPE_CHECKING:``: a lazy
import hides a dependency from the interpreter, not from the design."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "amsp_ext"

# Cycles that another change removes; each names its issue. Delete the entry with the cycle.
KNOWN_CYCLES: set[frozenset[str]] = set()

# The layers, bottom up (docs/DESIGN.md, Layers). A module imports its own layer and the ones
# below, never one above:
#   choices; schema and planner (neither imports the other); engine_config, then job; common
#   (the planner and choices only); topology; runtime (the engine); tools (dry run, profiler,
#   rendezvous); the applications: integrations, train, compare, tune; cli on top.
# cluster (the one-machine lab) stands beside them, importing none of amsp_ext's other layers but
# reap (the one process reaper, a leaf that the lab, train and compare share).
_APPS = ("amsp_ext.integrations", "amsp_ext.train", "amsp_ext.compare", "amsp_ext.tune", "amsp_ext.cli")
_ABOVE_ENGINE = ("amsp_ext.tools", *_APPS)
_ENGINE_AND_ABOVE = ("amsp_ext.runtime", *_ABOVE_ENGINE)
_TRAIN_APP = ("amsp_ext.train.loop", "amsp_ext.train.state", "amsp_ext.train.supervise",
              "amsp_ext.train.__main__")
# module prefix -> prefixes it must not import (a prefix ending in "." covers everything under it)
FORBIDDEN = {
    "amsp_ext.choices": ("amsp_ext.",),
    "amsp_ext.reap": ("amsp_ext.",),
    "amsp_ext.schema": ("amsp_ext.planner", "amsp_ext.engine_config", "amsp_ext.job", "amsp_ext.common",
                        "amsp_ext.topology", "amsp_ext.cluster", *_ENGINE_AND_ABOVE),
    "amsp_ext.planner": ("amsp_ext.schema", "amsp_ext.engine_config", "amsp_ext.job", "amsp_ext.common",
                         "amsp_ext.topology", "amsp_ext.cluster", *_ENGINE_AND_ABOVE),
    "amsp_ext.engine_config": ("amsp_ext.job", "amsp_ext.common", "amsp_ext.topology", "amsp_ext.cluster",
                               *_ENGINE_AND_ABOVE),
    "amsp_ext.job": ("amsp_ext.common", "amsp_ext.topology", "amsp_ext.cluster", *_ENGINE_AND_ABOVE),
    "amsp_ext.common": ("amsp_ext.schema", "amsp_ext.engine_config", "amsp_ext.job", "amsp_ext.topology",
                        "amsp_ext.cluster", *_ENGINE_AND_ABOVE),
    "amsp_ext.topology": ("amsp_ext.cluster", *_ENGINE_AND_ABOVE),
    "amsp_ext.runtime": ("amsp_ext.cluster", *_ABOVE_ENGINE),
    "amsp_ext.tools": ("amsp_ext.cluster", *_APPS),
    # the lab imports reap alone (docs/DESIGN.md)
    "amsp_ext.cluster": ("amsp_ext.choices", "amsp_ext.schema", "amsp_ext.planner", "amsp_ext.engine_config",
                         "amsp_ext.job", "amsp_ext.common", "amsp_ext.topology", *_ENGINE_AND_ABOVE),
    "amsp_ext.integrations": ("amsp_ext.tools", "amsp_ext.train", "amsp_ext.compare",
                              "amsp_ext.tune", "amsp_ext.cli"),
    # the config of `amsp train` stays torch-free: below the engine
    "amsp_ext.train.config": ("amsp_ext.topology", "amsp_ext.runtime", "amsp_ext.tools",
                              "amsp_ext.integrations", *_TRAIN_APP, "amsp_ext.compare", "amsp_ext.tune",
                              "amsp_ext.cli"),
    "amsp_ext.train": ("amsp_ext.compare", "amsp_ext.tune", "amsp_ext.cli"),
    "amsp_ext.compare": ("amsp_ext.train", "amsp_ext.tune", "amsp_ext.cli"),
    "amsp_ext.compare.harness": ("amsp_ext.runtime",),  # it plans "auto" with the planner alone
    "amsp_ext.tune": ("amsp_ext.cli", "amsp_ext.compare.harness"),
    "amsp_ext.cli": (),  # the top: every layer below
}
# an edge the layers allow by exception, with the reason in a Note (none today)
ALLOWED: set[tuple[str, str]] = set()
NEVER_TORCH = ("amsp_ext.planner", "amsp_ext.topology.groups", "amsp_ext.engine_config", "amsp_ext.job",
               "amsp_ext.choices", "amsp_ext.schema", "amsp_ext.train.config",
               "amsp_ext.tune.spec", "amsp_ext.tune.candidates", "amsp_ext.tune.analysis")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The amsp_ext module that ``name`` (a module or a module's attribute) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic_imports(tree: ast.Module) -> set[str]:
    """amsp_ext modules a module may import by name at run time: where it calls
    ``importlib.import_module`` or ``__import__``, every string (or f-string's leading text) in
    it that names an amsp_ext module or package, docstrings aside."""
    calls = any(isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == "import_module")
        or (isinstance(n.func, ast.Name) and n.func.id in ("__import__", "import_module")))
        for n in ast.walk(tree))
    if not calls:
        return set()
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)}
    out = set()
    for n in ast.walk(tree):
        text = None
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            text = n.value
        elif isinstance(n, ast.JoinedStr) and n.values and isinstance(n.values[0], ast.Constant):
            text = str(n.values[0].value).rstrip(".")
        if text and (text == "amsp_ext" or text.startswith("amsp_ext.")) and _owner(text):
            out.add(_owner(text))
    return out


def imports_of(module: str, source: str | None = None) -> tuple[set[str], set[str]]:
    """(amsp_ext modules, top-level third-party packages) that ``module`` imports anywhere:
    ``import`` statements at any depth and names it imports through importlib
    (``_dynamic_imports``). ``source``: the module's text (default: its file)."""
    path = MODULES.get(module)
    tree = ast.parse(source if source is not None else path.read_text(), str(path or module))
    mine, other = {m for m in _dynamic_imports(tree) if m != module}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module
                pkg = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "amsp_ext" or name.startswith("amsp_ext."):
                target = _owner(name)
                if target and target != module:
                    mine.add(target)
            else:
                other.add(name.split(".")[0])
    return mine, other


GRAPH = {m: imports_of(m)[0] for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_amsp_ext_modules():
    cycles = set(_cycles(GRAPH))
    unexpected = [sorted(c) for c in cycles - KNOWN_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"
    # a known cycle that is gone must leave KNOWN_CYCLES, so it cannot come back unnoticed
    assert not KNOWN_CYCLES - cycles, f"fixed, remove from KNOWN_CYCLES: {KNOWN_CYCLES - cycles}"


def _rules_for(module: str) -> list[str]:
    """Forbidden prefixes of ``module``: every FORBIDDEN entry it falls under."""
    out = []
    for prefix, forbidden in FORBIDDEN.items():
        if module == prefix or module.startswith(prefix + "."):
            out += forbidden
    return out


def _matches(target: str, prefix: str) -> bool:
    return target.startswith(prefix) if prefix.endswith(".") else (
        target == prefix or target.startswith(prefix + "."))


# the package's facades, above everything: amsp_ext (lazy engine and integrations) and
# amsp_ext.accelerate (the integrations' Accelerator under a short name)
FACADES = ("amsp_ext", "amsp_ext.accelerate")


def _behind(target: str, graph: dict[str, set[str]]) -> set[str]:
    """What importing ``target`` may bring in: itself, or for a facade every module behind it
    (transitively, through its imports and the names it imports lazily)."""
    if target not in FACADES:
        return {target}
    out, todo = set(), [target]
    while todo:
        t = todo.pop()
        for x in graph.get(t, ()):
            if x in FACADES and x not in out:
                todo.append(x)
            out.add(x)
    return out or {target}


def upward(module: str, targets: set[str], graph: dict[str, set[str]] = GRAPH) -> list[str]:
    """``module``'s imports of ``targets`` that its layer forbids, facades expanded."""
    rules = _rules_for(module)
    return [f"{module} -> {target}" + (f" ({t})" if t != target else "")
            for target in sorted(targets) for r in rules for t in sorted(_behind(target, graph))
            if _matches(t, r) and (module, t) not in ALLOWED]


def test_no_upward_imports():
    bad = [line for module, targets in sorted(GRAPH.items()) for line in upward(module, targets)]
    assert not bad, "upward imports:\n" + "\n".join(sorted(set(bad)))


def test_a_planted_import_through_a_facade_or_importlib_is_caught():
    """``from amsp_ext.accelerate import Accelerator`` in the engine, or an importlib string
    naming an application, is an upward edge like a plain import."""
    for source in ("from amsp_ext.accelerate import Accelerator\n",
                   "import importlib\nimportlib.import_module('amsp_ext.train.loop')\n",
                   "import amsp_ext\nx = amsp_ext.initialize\n"):
        mine, _ = imports_of("amsp_ext.runtime.planted", source)
        assert upward("amsp_ext.runtime.planted", mine), source
    mine, _ = imports_of("amsp_ext.cluster.planted", "from amsp_ext.choices import parse_size\n")
    assert upward("amsp_ext.cluster.planted", mine)


def test_every_module_is_in_a_layer():
    """A new package must be placed in a layer (FORBIDDEN) before it can import anything."""
    loose = [m for m in MODULES if m not in FACADES
             and not any(m == p or m.startswith(p + ".") for p in FORBIDDEN)]
    assert not loose, f"modules in no layer of FORBIDDEN: {sorted(loose)}"


def test_the_layers_refuse_an_upward_edge():
    """The rules catch the edges this layout removed (the engine importing a tool or an
    application, a shared leaf importing the engine)."""
    def refused(module: str, target: str) -> bool:
        return any(_matches(target, r) for r in _rules_for(module))

    for module, target in [("amsp_ext.runtime.shard", "amsp_ext.train.loop"),
                           ("amsp_ext.runtime.measure.peak", "amsp_ext.compare.worker"),
                           ("amsp_ext.runtime.engine", "amsp_ext.tools.dryrun"),
                           ("amsp_ext.topology.mesh", "amsp_ext.integrations.engine"),
                           ("amsp_ext.planner.issued", "amsp_ext.tune.worker"),
                           ("amsp_ext.planner.issued", "amsp_ext.common.models"),
                           ("amsp_ext.common.faults", "amsp_ext.runtime.collectives"),
                           ("amsp_ext.common.models", "amsp_ext.topology.groups"),
                           ("amsp_ext.tools.dryrun", "amsp_ext.cli.main")]:
        assert refused(module, target), f"{module} -> {target} passes the layer rules"
    for module, target in [("amsp_ext.runtime.shard", "amsp_ext.common.faults"),
                           ("amsp_ext.tools.dryrun", "amsp_ext.runtime.shard"),
                           ("amsp_ext.train.loop", "amsp_ext.tools.rendezvous")]:
        assert not refused(module, target), f"{module} -> {target} is refused"


def test_the_planner_and_the_schema_never_import_torch():
    bad = [m for m in MODULES if any(m == p or m.startswith(p + ".") for p in NEVER_TORCH)
           and "torch" in imports_of(m)[1]]
    assert not bad, f"import torch: {bad}"
    # and importing them (and `amsp --help`) does not load torch through anything else
    code = ("import sys, amsp_ext.planner.search, amsp_ext.planner.auto, amsp_ext.train.config, "
            "amsp_ext.integrations.settings, amsp_ext.compare.config; "
            "from amsp_ext.cli.main import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_private_name_is_imported_from_another_module():
    """What two modules share is public and lives where it belongs (``_torch_compat`` is the
    module of private torch names, imported as a whole)."""
    import ast as _ast

    bad = []
    for module, path in sorted(MODULES.items()):
        for node in _ast.walk(_ast.parse(path.read_text())):
            if isinstance(node, _ast.ImportFrom) and (node.module or "").startswith("amsp_ext"):
                bad += [f"{module}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_torch_compat"]
    assert not bad, "\n".join(bad)


def _rooms() -> set[str]:
    """The top-level rooms of amsp_ext: its packages and modules (no __init__)."""
    return {p.name if p.is_dir() else p.name for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")}


def test_design_layers_and_readme_architecture_name_every_room():
    """docs/DESIGN.md's layer list (with the lab and the facades beside it) and README.md's
    Architecture block name every top-level room of the tree, and no room that is gone."""
    import re

    design = (PACKAGE.parent / "docs" / "DESIGN.md").read_text()
    layers = design.split("## Layers", 1)[1].split("```", 1)[0]
    readme = (PACKAGE.parent / "README.md").read_text()
    block = readme.split("## Architecture", 1)[1].split("```")[1]
    rooms = {r.removesuffix(".py") for r in _rooms()}
    for what, text in (("docs/DESIGN.md's Layers", layers), ("README.md's Architecture", block)):
        named = {m.group(1).removesuffix(".py").rstrip("/")
                 for m in re.finditer(r"(?:`|^\s+)(?:amsp_ext/)?([a-z_]+(?:\.py|/))", text, flags=re.M)}
        missing, stale = rooms - named, {n for n in named if n not in rooms and n not in ("__init__", "tests", "docs")}
        assert not missing, f"{what} does not name {sorted(missing)}"
        assert not stale, f"{what} names rooms that are gone: {sorted(stale)}"
