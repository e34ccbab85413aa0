"""docs/architecture.md held to the code: every module listed where it is and nothing
listed that is not, the owners and the glossary where the page says, and the imports
between a stage's sub-stages in the page's order."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "graphsafe"
PAGE = ROOT / "docs" / "architecture.md"
_SOURCES = (".py", ".cpp", ".h")


def _sections(text: str) -> dict[str, str]:
    """`### \\`stage\\`` heading -> the text under it."""
    parts = re.split(r"^### `([^`]+)`\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def _listed(section: str) -> list[str]:
    """The module paths of a section's table (its first column)."""
    return re.findall(r"^\| `([\w/.]+)` \|", section, flags=re.M)


def _folder(stage: str) -> Path:
    return PACKAGE if stage == "graphsafe" else PACKAGE / stage


def _modules(stage: str) -> set[str]:
    """Every source file of `stage`, by its path in the stage's folder (`__init__.py`
    files aside; the top-level `graphsafe` section holds only loose modules)."""
    folder = _folder(stage)
    files = folder.glob("*") if stage == "graphsafe" else folder.rglob("*")
    return {
        p.relative_to(folder).as_posix() for p in files
        if p.suffix in _SOURCES and p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def _stages() -> set[str]:
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return found | {"graphsafe"}


def test_every_stage_has_its_section_and_every_section_is_a_stage() -> None:
    sections = _sections(PAGE.read_text())
    assert set(sections) == _stages()


@pytest.mark.parametrize("stage", sorted(_stages()))
def test_the_page_lists_every_module_of_a_stage_and_only_those(stage: str) -> None:
    listed = _listed(_sections(PAGE.read_text())[stage])
    assert len(listed) == len(set(listed)), "a module listed twice"
    missing = _modules(stage) - set(listed)
    stale = set(listed) - _modules(stage)
    assert not missing, f"modules of {stage} missing from docs/architecture.md: {missing}"
    assert not stale, f"docs/architecture.md lists modules {stage} does not have: {stale}"


def _defined(module: Path, name: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under `## heading`."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_each_owner_is_a_class_of_the_module_the_page_names() -> None:
    rows = _table(PAGE.read_text(), "Who owns what")
    assert len(rows) >= 10
    for state, owner, changed in rows:
        match = re.match(r"`(\w+)` \(`([\w/]+\.py)`", owner)
        assert match, f"owner of {state!r} names no class and module: {owner}"
        cls, path = match.groups()
        module = PACKAGE / path
        assert module.exists(), f"{path} (owner of {state!r}) does not exist"
        assert _defined(module, cls), f"{cls} is not defined in {path}"
        methods = re.findall(r"`(\w+)`", changed.split(";")[0])
        source = module.read_text()
        for method in methods:
            assert f"def {method}(" in source or method.startswith("gs"), (
                f"{cls}.{method} (how {state!r} changes) is not in {path}")


def test_each_glossary_term_is_defined_where_the_page_says() -> None:
    rows = _table(PAGE.read_text(), "Glossary")
    terms = [row[0].strip("`") for row in rows]
    assert len(terms) == len(set(terms)), "a term defined twice"
    for row in rows:
        term, where = row[0].strip("`"), row[2].strip("`")
        assert _defined(PACKAGE / where, term), f"{term} is not defined in {where}"


def _imports(module: Path) -> set[str]:
    """The graphsafe modules `module` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("graphsafe.")}


def _orders() -> list[tuple[str, list[list[str]]]]:
    """(stage, sub-stage groups in order) for each `Order of ...'s sub-stages:` line."""
    found = []
    for stage, rest in re.findall(r"^Order of `(\w+)`'s sub-stages: (.+)$", PAGE.read_text(),
                                  flags=re.M):
        groups = [re.findall(r"`?(\w+)`?", group) for group in rest.rstrip(".").split("→")]
        found.append((stage, groups))
    return found


def _position(stage: str, groups: list[list[str]], dotted: str) -> int | None:
    """Which group of `stage`'s order the module `dotted` belongs to (None: another
    stage); a module at the stage's top that no group names is in `top`."""
    prefix = f"graphsafe.{stage}."
    if not dotted.startswith(prefix):
        return None
    first = dotted[len(prefix):].split(".")[0]
    for i, group in enumerate(groups):
        if first in group:
            return i
    top = next(i for i, group in enumerate(groups) if "top" in group)
    return top if (PACKAGE / stage / f"{first}.py").exists() else None


def test_the_page_gives_the_order_of_every_stage_with_sub_stages() -> None:
    nested = {p.parent.parent.name for p in PACKAGE.glob("*/*/__init__.py")}
    assert {stage for stage, _ in _orders()} >= nested - {"integrations"}


@pytest.mark.parametrize(("stage", "groups"), _orders(), ids=[s for s, _ in _orders()])
def test_imports_between_sub_stages_follow_the_pages_order(
    stage: str, groups: list[list[str]]
) -> None:
    named = {name for group in groups for name in group} - {"top"}
    folder = PACKAGE / stage
    parts = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
    assert named <= parts, f"the order of {stage} names what it does not hold: {named - parts}"
    assert {p for p in parts if (folder / p).is_dir()} <= named, "a sub-stage is not ordered"
    against = []
    for module in folder.rglob("*.py"):
        if module.name == "__init__.py" and module.parent == folder:
            continue  # the stage's face re-exports every sub-stage
        dotted = ".".join(module.relative_to(ROOT).with_suffix("").parts)
        here = _position(stage, groups, dotted.removesuffix(".__init__"))
        assert here is not None
        for target in _imports(module):
            there = _position(stage, groups, target)
            if there is not None and there > here:
                against.append(f"{dotted} imports {target}")
    assert not against, "imports against the page's order: " + "; ".join(sorted(against))
