"""Every page of the docs runs as written.

Each ```python block of a page under `docs/` runs, in order, in one namespace per page,
so a page's blocks may build on its earlier ones (the README has its own test). A block
is run as shown unless an HTML comment right before its fence (blank lines allowed)
says otherwise; the comment does not render on the site:

- `<!-- raises: gs.StaleError -->`: the block must raise that exception (an expression
  evaluated in the page's namespace, so `gs.X`, or a builtin like `KeyError`); the page
  goes on with the next block. When a plain fence follows right after, showing the
  message (`graphsafe.StaleError: ...`), the message raised must be that text, storage
  addresses (`0x...`) aside.
- `<!-- no-run: why -->`: the block is not run (it needs a GPU, say); the
  reason is required and shows in the markdown source.
- `<!-- script: why -->`: the block runs as a script of its own, `python block.py` in a
  fresh process from the repository root, as a user would paste it, and must exit 0 (a
  block that starts processes, which import the main module again); the reason is
  required. It does not share the page's namespace.

Any other comment of the form `<!-- word: ... -->` before a fence is refused, so a typo
in a marker cannot turn a block off silently.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

# A fenced block: the fence's indentation (admonitions indent it), its info string, its
# body, and the closing fence at the same indentation.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
# The HTML comment right before a fence, if any.
_MARKER = re.compile(r"<!--\s*(?P<kind>[\w-]+)\s*:\s*(?P<arg>.*?)\s*-->\s*\Z", re.S)
_KINDS = ("raises", "no-run", "script")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block of a page."""

    line: int
    """Line of the opening fence, 1-based."""
    code: str
    """The block's code, dedented."""
    kind: str
    """`run`, `raises`, `no-run` or `script`."""
    arg: str
    """The exception expression of `raises`, the reason of `no-run` or `script`, else
    empty."""
    shown: str | None = None
    """The body of a plain fence right after the block (its printed error), if any."""


def python_blocks(text: str, page: str = "<page>") -> list[Block]:
    """The ```python blocks of a markdown page, in order, with their markers.

    Args:
        text: The page's markdown.
        page: Its name, for error messages.

    Returns:
        The blocks.

    Raises:
        ValueError: A marker is unknown, or `no-run` gives no reason.
    """
    blocks = []
    fences = list(_FENCE.finditer(text))
    for i, m in enumerate(fences):
        if m["info"].strip().split(" ")[0] != "python":
            continue
        shown = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            if not nxt["info"].strip() and not text[m.end() : nxt.start()].strip():
                shown = textwrap.dedent(nxt["body"])
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip()
        marker = _MARKER.search(before[before.rfind("<!--") :]) if "<!--" in before else None
        kind, arg = "run", ""
        if marker is not None and before.endswith("-->"):
            kind, arg = marker["kind"], marker["arg"]
            if kind not in _KINDS:
                raise ValueError(
                    f"{page}:{line}: unknown marker <!-- {kind}: ... --> before a python "
                    f"block; expected one of {_KINDS}"
                )
            if not arg:
                raise ValueError(f"{page}:{line}: <!-- {kind}: --> needs an argument")
        code = textwrap.dedent(m["body"]) if m["indent"] else m["body"]
        blocks.append(Block(line=line, code=code, kind=kind, arg=arg, shown=shown))
    return blocks


def run_page(path: Path) -> int:
    """Run a page's blocks in order in one namespace; return how many ran.

    Args:
        path: The markdown page.

    Returns:
        The number of blocks executed (`raises` blocks included).

    Raises:
        AssertionError: A `raises` block did not raise its exception.
    """
    blocks = python_blocks(path.read_text(), path.name)
    # A real module, so that what looks classes up by `__module__` (dataclasses,
    # pickle) finds the page's namespace, as it would find a user's script.
    module = types.ModuleType(f"docs_{path.stem.replace('-', '_')}")
    module.__file__ = str(path)
    namespace = module.__dict__
    sys.modules[module.__name__] = module
    ran = 0
    try:
        for block in blocks:
            if block.kind == "no-run":
                continue
            # Padding keeps tracebacks pointing at the page's own line numbers;
            # dont_inherit: this file's `from __future__` must not leak into the page.
            code = compile("\n" * block.line + block.code, str(path), "exec", dont_inherit=True)
            if block.kind == "script":
                _run_script(block, path)
            elif block.kind == "raises":
                expected = eval(block.arg, namespace)  # the page's own marker
                with pytest.raises(expected) as info:
                    exec(code, namespace)
                if block.shown is not None:
                    _check_shown(info.value, block.shown, f"{path.name}:{block.line}")
            else:
                exec(code, namespace)
            ran += 1
    finally:
        del sys.modules[module.__name__]
    return ran


def _run_script(block: Block, page: Path) -> None:
    """Run `block` as `python block.py` in a fresh process; it must exit 0."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / f"{page.stem}_line{block.line}.py"
        script.write_text(block.code)
        done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                              text=True, timeout=900, check=False)
    assert done.returncode == 0, (
        f"{page.name}:{block.line}: the script exited {done.returncode}\n"
        f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )


def _printed(err: BaseException) -> str:
    """How Python prints an uncaught `err`'s last line(s): `module.Class: message`."""
    cls = type(err)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    return f"{name}: {err}"


def _check_shown(err: BaseException, shown: str, where: str) -> None:
    """The error a block raised must read as the page shows it, addresses aside."""

    def norm(text: str) -> str:
        # Where the checkout lives is not part of the message a page shows.
        text = text.replace(str(ROOT) + "/", "")
        return re.sub(r"0x[0-9a-fA-F]+", "0x...", text).strip()

    assert norm(_printed(err)) == norm(shown), (
        f"{where}: the error shown after this block is not the one it raises\n"
        f"shown:\n{shown.strip()}\nraised:\n{_printed(err)}"
    )


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_docs_page_runs(page: str) -> None:
    run_page(DOCS / page)


def test_every_page_is_collected() -> None:
    assert PAGES, "docs/ has markdown pages"
    assert any(python_blocks(p.read_text(), p.name) for p in PAGES)


# -----------------------------------------------------------------------------
# the runner itself


def test_blocks_of_one_page_share_a_namespace(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```python\nx = 2\n```\n\ntext\n\n```python\nassert x == 2\n```\n")
    assert run_page(page) == 2


def test_a_failing_block_fails_the_page(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'wrong'\n```\n")
    with pytest.raises(AssertionError, match="wrong"):
        run_page(page)


def test_other_languages_are_not_run(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```\nraise SystemExit\n```\n\n```toml\n[x]\n```\n")
    assert run_page(page) == 0


def test_indented_blocks_run(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        '??? note "Setup"\n    ```python\n    y = 3\n    ```\n\n```python\nassert y\n```\n'
    )
    assert run_page(page) == 2


def test_raises_marker_needs_the_exception(tmp_path: Path) -> None:
    ok = tmp_path / "ok.md"
    ok.write_text("<!-- raises: KeyError -->\n```python\n{}['a']\n```\n")
    assert run_page(ok) == 1
    silent = tmp_path / "silent.md"
    silent.write_text("<!-- raises: KeyError -->\n```python\nx = 1\n```\n")
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        run_page(silent)


def test_shown_error_must_match_the_raised_one(tmp_path: Path) -> None:
    same = tmp_path / "same.md"
    same.write_text(
        "<!-- raises: KeyError -->\n```python\n{}['a' + hex(id(1))]\n```\n\n"
        "```\nKeyError: 'a0x7f00'\n```\n"
    )
    assert run_page(same) == 1  # addresses may differ from run to run
    stale = tmp_path / "stale.md"
    stale.write_text(
        "<!-- raises: KeyError -->\n```python\n{}['b']\n```\n\n```\nKeyError: 'a'\n```\n"
    )
    with pytest.raises(AssertionError, match="not the one it raises"):
        run_page(stale)


def test_no_run_marker_skips_only_its_block(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "<!-- no-run: needs a GPU -->\n\n```python\nraise SystemExit\n```\n\n"
        "```python\nx = 1\n```\n"
    )
    assert run_page(page) == 1


def test_script_blocks_run_as_a_main_module_of_their_own(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "```python\nx = 1\n```\n\n<!-- script: it starts processes -->\n"
        "```python\nimport sys\nassert __name__ == '__main__' and 'x' not in dir()\n"
        "if __name__ == '__main__':\n    sys.exit(0)\n```\n"
    )
    assert run_page(page) == 2


def test_a_script_that_fails_fails_the_page(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("<!-- script: why -->\n```python\nraise SystemExit('broken')\n```\n")
    with pytest.raises(AssertionError, match=r"p\.md:2: the script exited 1(.|\n)*broken"):
        run_page(page)


def test_a_marker_further_up_does_not_apply(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("<!-- no-run: needs a GPU -->\n\ntext\n\n```python\nassert False, 'ran'\n```\n")
    with pytest.raises(AssertionError, match="ran"):
        run_page(page)


@pytest.mark.parametrize(
    ("marker", "message"),
    [("<!-- no-rn: typo -->", "unknown marker"), ("<!-- no-run: -->", "needs an argument")],
)
def test_bad_markers_are_refused(tmp_path: Path, marker: str, message: str) -> None:
    page = tmp_path / "p.md"
    page.write_text(f"{marker}\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match=message):
        run_page(page)


# -----------------------------------------------------------------------------
# docs/adopting.md's troubleshooting table


def _troubleshooting_rows() -> list[str]:
    text = (DOCS / "adopting.md").read_text()
    table = text[text.index("| error: first line |"):].split("\n\n")[0]
    return [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]


def test_the_troubleshooting_table_names_errors_graphsafe_raises() -> None:
    """Each row's class is graphsafe's, and each literal part of its message shape (the
    text between `...` and counts) is in the source that raises it, or, for a message
    composed of parts, in an error errors.md shows (those shown after a block are held to
    what it raises): a message reworded in the code fails here until the table says it
    too."""
    import graphsafe as gs

    source = "\n".join(p.read_text() for d in ("graphsafe", "models")
                       for p in sorted((ROOT / d).rglob("*.py")))
    source = " ".join((source + (DOCS / "errors.md").read_text()).split())
    rows = _troubleshooting_rows()
    assert rows
    for row in rows:
        for name, message in _shapes(row):
            assert isinstance(getattr(gs, name, None), type), row
            for part in re.split(r"\.\.\.|'\.\.\.'|\bN\b|`", message):
                part = part.strip(" '`()")
                if len(part) >= 8:
                    assert part in source, f"{row!r}: {part!r} is in no message"


def test_every_error_class_has_a_troubleshooting_row() -> None:
    import graphsafe as gs

    classes = {n for n in gs.__all__ if isinstance(getattr(gs, n), type)
               and issubclass(getattr(gs, n), (gs.GraphSafetyError, gs.GraphSafetyWarning))}
    listed = {name for row in _troubleshooting_rows() for name, _ in _shapes(row)}
    assert classes <= listed, classes - listed


def _shapes(row: str) -> list[tuple[str, str]]:
    """A row's message shapes, `Class: text` or (after the first) `text` of the same
    class, separated by ` / `: (class name, text)."""
    out: list[tuple[str, str]] = []
    for shape in row.split(" / "):
        m = re.fullmatch(r"(\w+(?:Error|Warning)): (.*)", shape.strip().strip("`"))
        if m is not None:
            out.append((m[1], m[2]))
        else:
            out.append((out[-1][0], shape.strip().strip("`")))
    return out
