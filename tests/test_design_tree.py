"""docs/DESIGN.md's tree is the source tree: every package and module of amsp_ext is named
there, and every path the tree names exists."""

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
