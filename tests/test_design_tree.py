"""docs/DESIGN.md's tree is the source tree: every package and module of amsp_ext is named
there, and every path the tree names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "amsp_ext"
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()
TREE = DESIGN[DESIGN.index("```\namsp_ext/choices.py"):]
TREE = TREE[:TREE.index("\n```\n", 4)]


# described folder by folder (one module per subcommand, system, patch or tune step)
BY_FOLDER = ("cli", "compare", "tune", "patches")


def test_every_module_and_folder_is_in_the_design_tree():
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if path.name == "__init__.py" or "profiles" in rel.parts or set(rel.parts) & set(BY_FOLDER):
            continue
        if not re.search(rf"(?<![\w]){re.escape(path.stem)}\.py", TREE):
            missing.append(str(path.relative_to(PKG)))
    for folder in sorted(p for p in PKG.rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
        if folder != PKG and folder.name != "profiles" and f"{folder.name}/" not in TREE:
            missing.append(f"{folder.relative_to(PKG)}/")
    assert not missing, f"not in docs/DESIGN.md's tree: {missing}"


def test_the_design_tree_names_only_what_exists():
    named = re.findall(r"^(amsp_ext/[\w/]+(?:\.py)?)", TREE, flags=re.M)
    assert named and all((ROOT / n).exists() for n in named), [n for n in named if not (ROOT / n).exists()]


# [Note: functions read top to bottom]
# A function longer than this is split into named steps (issue 20). A function that must stay
# longer is listed here with its reason; none needs to today.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _function_lengths(source: str):
    """``(qualified name, lines from def to end)`` of every function in ``source``."""
    import ast

    out = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((f"{prefix}{child.name}", child.end_lineno - first + 1))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def test_the_length_check_counts_lines_from_decorator_to_end():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = "class A:\n    @staticmethod\n    def long():\n" + body
    got = dict(_function_lengths(src))
    assert got == {"A.long": MAX_FUNCTION_LINES + 2}, got  # decorator + def + 80 body lines
    assert dict(_function_lengths("def f():\n    def g():\n        return 1\n    return g\n")) == {
        "f": 4, "f.g": 2}


def test_no_function_over_80_lines():
    too_long = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, n in _function_lengths(path.read_text()):
            key = f"{rel}:{name}"
            if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS_ALLOWED:
                too_long.append(f"{key} ({n} lines)")
    assert not too_long, f"split these into named steps (or list them with a reason): {too_long}"
    stale = [k for k in LONG_FUNCTIONS_ALLOWED if not (ROOT / k.split(":")[0]).exists()]
    assert not stale, stale


# [Note: one definition per default] The planner inputs that many entry points default (the
# profile, the GPU memory a plan is made for, the reserve) are written once, in
# planner/defaults.py; a second literal is a default that will drift. Docstrings may quote them.
SHARED_DEFAULTS = {"paper-a800", "80GiB", "2GiB", "80 * 2 ** 30", "80 * GiB", "2 * 2 ** 30", "25 * 2 ** 20"}
DEFAULTS_HOME = {"planner/defaults.py", "planner/profiles/build_paper_a800.py"}  # the profile's own name


def _default_literals(tree):
    import ast

    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings and node.value in SHARED_DEFAULTS:
            yield node.lineno, node.value
        elif isinstance(node, ast.BinOp) and ast.unparse(node) in SHARED_DEFAULTS:
            yield node.lineno, ast.unparse(node)


def test_shared_planner_defaults_are_defined_once():
    import ast

    found = [f"{path.relative_to(PKG)}:{line}: {text}"
             for path in sorted(PKG.rglob("*.py")) if str(path.relative_to(PKG)) not in DEFAULTS_HOME
             for line, text in _default_literals(ast.parse(path.read_text()))]
    assert not found, f"define these in amsp_ext/planner/defaults.py and import them: {found}"


def test_the_default_scan_finds_a_planted_literal():
    import ast

    planted = ast.parse('"""docstring: paper-a800"""\nx = f(profile="paper-a800", size=80 * 2**30)\n')
    assert sorted(text for _, text in _default_literals(planted)) == ["80 * 2 ** 30", "paper-a800"]


# [Note: one definition of each recipe]
# The engine is assembled in one function (runtime/engine.py build_engine: shard() and
# switch_plan() call it), one step's micro-batch loop is written once (runtime/step.py
# train_step: amsp train, the compare rows, amsp tune and the dry run call it), the job shape
# from engine settings once (engine_config.py training_spec), the bucket layout once
# (planner/buckets.py). A second copy of any drifts from the first unnoticed. Each pattern's
# allowed places, with why the others are not copies:
ONE_DEFINITION = {
    r"(?<!class )(?<![\"'])\bAMSPOptimizer\(": {"runtime/engine.py"},  # built, not declared
    r"\bEngine\(parts": {"runtime/engine.py"},
    r"\bbuild_parts\(": {"runtime/engine.py"},
    # a baseline's own loop (compare/systems/ddp.py: torch DDP's no_sync) is not the engine's step
    r"(?<!ddp)\.no_sync\(\)": {"runtime/step.py"},
    # every route builds a Job (amsp_ext/job.py), whose engine settings engine_config.py's
    # training_spec turns into the planner's TrainingSpec; planner/specs.py's paper_job is the
    # paper's job by name
    r"\bTrainingSpec\(": {"planner/specs.py", "engine_config.py"},
    # the memory a CPU rank gives the planner (topology/profile_cache.py cpu_memory_per_rank)
    r"virtual_memory\(\)\.total\s*//": {"topology/profile_cache.py"},
    r"\bUNIT_BUCKET_MIN_BYTES\s*=|\bIN_FLIGHT_BUCKETS\s*=": {"planner/buckets.py"},
    # the planner decides "auto" for a job only through amsp_ext/job.py resolve()
    r"\bresolve_auto\(": {"job.py", "planner/auto.py"},
    # defaults read by several routes: the collective timeout (engine_config.py DEFAULT_TIMEOUT_S),
    # the paper GPU's peak, the optimizer the planner assumes, the precision -> torch dtype map
    # (build_paper_a800.py: the paper's 300 Gb/s and 600 GB/s links, in its generated text)
    r"\b600(\.0)?\b(?![eE])": {"engine_config.py", "planner/profiles/build_paper_a800.py",
                            "compare/config.py"},  # SYSTEM_TIMEOUT_S: a wall clock, not a collective's
    r"\b300(\.0)?\b(?![eE])": {"compare/config.py",  # WORKER_TIMEOUT_S (its comment says why lower)
                            "planner/profiles/build_paper_a800.py",
                            "compare/launch.py"},  # a log tail's length, not a timeout
    r"\b1800(\.0)?\b(?![eE])": {"cluster/launch.py"},  # JOB_TIMEOUT_S: the lab job's wall clock
    r"\b312e12\b": {"planner/defaults.py"},
    r"(?<![=!<>])=\s*\"adamw\"\s*[,)\n]": {"planner/defaults.py"},
    r"[\"'](fp32|bf16|fp16)[\"']:\s*torch\.": {"runtime/config.py"},
}


def code_only(source: str) -> str:
    """``source`` without its comments and its string statements (docstrings, and strings
    standing alone), every other line kept in place: tokenize finds the comments, ast the
    string statements, so a docstring's closing quotes never pair with the next one's opening."""
    import io
    import tokenize

    lines = source.splitlines()
    drop: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            drop.update(range(node.lineno, node.end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join("" if n in drop else line for n, line in enumerate(lines, 1))


def test_each_recipe_is_defined_once():
    bad = []
    code = {path.relative_to(PKG).as_posix(): code_only(path.read_text()).splitlines()
            for path in sorted(PKG.rglob("*.py"))}
    for pattern, allowed in ONE_DEFINITION.items():
        assert all((PKG / a).is_file() for a in allowed), f"{pattern}: an allowed file is gone: {allowed}"
        for rel, lines in code.items():
            if rel in allowed:
                continue
            bad += [f"{rel}:{n}: {pattern}: {line.strip()}" for n, line in enumerate(lines, 1)
                    if re.search(pattern, line)]
    assert not bad, "a second definition:\n" + "\n".join(bad)


def test_the_one_definition_patterns_find_a_second_copy():
    planted = {"timeout_s: float = 600.0", "peak_flops=312e12", 'optimizer: str = "adamw"\n',
               'f(x, optimizer="adamw")', '{"bf16": torch.bfloat16}', "timeout=1800", "min(300.0, t)",
               "psutil.virtual_memory().total // gpus_per_node", "timedelta(seconds=600)"}
    for text in planted:
        assert any(re.search(p, text) for p in ONE_DEFINITION), text
    assert not any(re.search(p, "ANCHOR = 300e9; NVLINK = 600e9") for p in ONE_DEFINITION)


def test_code_only_keeps_code_after_docstrings_and_drops_strings_and_comments():
    """The old docstring regex paired one docstring's closing quotes with the next one's
    opening and hid the code between them: a literal after a function's docstring is found."""
    planted = ('"""Module."""\n'
               'def f():\n    """Doc."""\n    return g(timeout=600)  # 600 in a comment\n'
               'def h():\n    """Doc two\n    spanning lines, 600."""\n    "a string statement, 600"\n'
               '    return 1\n')
    code = code_only(planted)
    hits = [line for line in code.splitlines() if re.search(r"\b600\b", line)]
    assert hits == ['    return g(timeout=600)  '], hits
    assert "spanning" not in code and "Module" not in code


# [Note: Notes state invariants] A comment or docstring in amsp_ext says what holds and why; the
# issue, the session or the day that taught it is history, kept in comparisons/results/.
HISTORY = re.compile(r"issue [0-9]+|[Ss]ession [0-9]+|2026-1[12]-[0-9]{2}")


def test_no_history_in_the_package():
    found = [f"{path.relative_to(PKG)}:{n}: {line.strip()}"
             for path in sorted(PKG.rglob("*")) if path.is_file() and "__pycache__" not in path.parts
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not found, "history in amsp_ext (cite a comparisons/results/ file instead):\n" + "\n".join(found)


_MUTATORS = {"append", "extend", "update", "add", "pop", "popitem", "clear", "setdefault", "remove",
             "discard", "insert", "appendleft"}


def _module_state_writes(tree: ast.Module) -> set[str]:
    """What functions of a module do to its module-level names: ``global`` rebinds, mutating
    calls (``_seen.append(...)``), item and attribute assignments (``_cache[k] = ...``)."""
    top = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        top.update(t.id for t in targets if isinstance(t, ast.Name))
    writes = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                writes.update(f"global {x}" for x in n.names)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in top:
                writes.add(f"{n.func.value.id}.{n.func.attr}()")
            elif isinstance(n, (ast.Assign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) \
                            and t.value.id in top:
                        writes.add(f"{t.value.id}[...] =")
    return writes


def test_no_module_level_mutable_state_outside_the_integrations():
    """A module's functions never change its module-level names, except in integrations/ (the
    start-up hook and the patches, which must remember what they applied in one interpreter)."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("integrations/"):
            continue
        writes = _module_state_writes(ast.parse(path.read_text()))
        if writes:
            found[rel] = sorted(writes)
    assert not found, f"module-level state written by functions: {found}"
    planted = ast.parse("_seen = []\nX = {}\ndef f():\n    global Y\n    _seen.append(1)\n    X['k'] = 2\n")
    assert _module_state_writes(planted) == {"global Y", "_seen.append()", "X[...] ="}


# [Note: one reader of "auto"] A plan, all-reduce or tensor-parallel request of "auto" is decided
# by amsp_ext/job.py resolve() alone, and read with planner/plan.py is_auto(): a second module
# that compares a request with the text "auto" is a second resolver that drifts from the first
# (one launcher planned without the reduce dtype while its ranks planned with it). Other "auto"s
# are not requests (a ds_config's placeholders, --resume auto, amsp profile's --backend auto).
REQUEST_NAMES = re.compile(r"plan|all_reduce|tensor_parallel|tp_degree|request")
AUTO_READERS_ALLOWED = {"planner/plan.py"}  # is_auto itself


def auto_readers(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every comparison of a request with "auto" in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        autos = [s for s in sides if (isinstance(s, ast.Constant) and s.value == "auto")
                 or (isinstance(s, (ast.Tuple, ast.List, ast.Set))
                     and any(isinstance(e, ast.Constant) and e.value == "auto" for e in s.elts))]
        others = " ".join(ast.unparse(s) for s in sides if s not in autos)
        if autos and REQUEST_NAMES.search(others):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_auto_is_read_by_the_resolver_alone():
    bad = [f"{path.relative_to(PKG)}:{line}: {code}" for path in sorted(PKG.rglob("*.py"))
           if path.relative_to(PKG).as_posix() not in AUTO_READERS_ALLOWED
           for line, code in auto_readers(path.read_text())]
    assert not bad, "a second reader of 'auto' (decide it in amsp_ext/job.py, read it with is_auto):\n" + \
        "\n".join(bad)


def test_the_auto_scan_finds_a_planted_reader():
    planted = ('if spec.amsp_plan.strip().lower() == "auto":\n    pass\n'
               'if config.engine.all_reduce in ("auto", "flat"):\n    pass\n'
               'if v == "auto":\n    pass\n'  # a ds_config placeholder: not a request
               'if is_auto(job.plan):\n    pass\n')
    assert [line for line, _ in auto_readers(planted)] == [1, 3]
