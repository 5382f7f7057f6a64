"""docs/architecture.md against the code: every module listed once, no module that is not there,
and the import order it states is the one the code keeps."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lossysim"
DOC = ROOT / "docs" / "architecture.md"
# Packages' __init__.py only re-export and __main__.py only calls cli.main: the doc says so once.
UNLISTED = ("__init__.py", "__main__.py")
# An axis's parts that belong to a later stage than its package: its declaration (``cp/axis.py``) is the stage
# ``axes`` (config reads it before its package), its part of the estimate's job (``cp/estimate.py``) the
# stage ``estimate`` (it builds on the estimate's accounting; the package stays free of the estimate).
AXIS_PARTS = {"axis": "axes", "estimate": "estimate"}


def _modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name not in UNLISTED}


def _listed(text: str) -> list[str]:
    """The module list: lines ``- `path.py`: what it is for``."""
    return re.findall(r"^- `([\w/]+\.py)`: \S", text, flags=re.MULTILINE)


def _order(text: str) -> dict[str, int]:
    """Each stage's place in the doc's import line ``a, b  ->  c  -> ...`` (an indented block)."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith("    ") and "->" in ln]
    return {name.strip(): i for i, group in enumerate(line.split("->")) for name in group.split(",")}


def _stage(module: str) -> str:
    """``net/links.py`` -> ``net``; ``config.py`` -> ``config``; an axis's declaration (``cp/axis.py``) is
    the stage ``axes``, with ``axes.py`` that collects them: config reads it before its package; its part
    of the estimate (``cp/estimate.py``) the stage ``estimate`` (``AXIS_PARTS``)."""
    parts = module.split("/")
    if len(parts) == 2 and parts[1].removesuffix(".py") in AXIS_PARTS and (PACKAGE / parts[0] / "axis.py").exists():
        return AXIS_PARTS[parts[1].removesuffix(".py")]
    return parts[0].removesuffix(".py")


def _imported_stages(path: Path) -> set[str]:
    """The stages a module imports from (relative or absolute, at any depth, lazy imports included)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    stages = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [[*target, a.name] for a in node.names] if not node.module else [target]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for parts in names:
            # `from .. import __version__` names the package itself, no stage
            if parts[0] == "lossysim" and len(parts) > 1 and (
                    (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").exists()):
                part = len(parts) == 3 and parts[2] in AXIS_PARTS
                stages.add(_stage("/".join(parts[1:]) + ".py" if part else parts[1]))
    return stages


def test_every_module_is_listed_once():
    listed = _listed(DOC.read_text())
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    assert not repeated, f"docs/architecture.md lists these modules more than once: {repeated}"
    missing = sorted(_modules() - set(listed))
    assert not missing, f"docs/architecture.md lacks a line for: {missing}"
    gone = sorted(set(listed) - _modules())
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


def test_every_file_the_doc_names_exists():
    named = set(re.findall(r"`([\w./]+\.py)`", DOC.read_text()))
    gone = sorted(n for n in named if not (PACKAGE / n).exists() and not (ROOT / n).exists())
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"


def test_imports_follow_the_stated_order():
    order = _order(DOC.read_text())
    unplaced = sorted({_stage(m) for m in _modules()} - set(order))
    assert not unplaced, f"stages missing from the import line of docs/architecture.md: {unplaced}"
    against = []
    for module in sorted(_modules()):
        own = _stage(module)
        for stage in _imported_stages(PACKAGE / module) - {own}:
            if order[stage] >= order[own]:
                against.append(f"{module} imports {stage}")
    assert not against, f"imports against the order docs/architecture.md states: {against}"
