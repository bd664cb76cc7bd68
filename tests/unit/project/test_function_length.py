"""No function of the product longer than MAX_LINES without a stated reason (issue 25: phases,
not long functions). A long one is split into named phases, the way gang/policy.py reads; one
that must stay long says why in a `# long: <reason>` comment on its def line or the line
above it. bench/ and tests/ are not held to this."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("bootstrap", "images", "gang", "lab", "nodeforge")
MAX_LINES = 80
REASON = re.compile(r"#\s*long:\s*\S")


def long_functions(source: str, name: str) -> list[str]:
    """`name:line function (N lines)` for each def over MAX_LINES without a stated reason."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
        if length <= MAX_LINES:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        said = {lines[node.lineno - 1], lines[first - 2] if first > 1 else ""}
        if not any(REASON.search(text) for text in said):
            found.append(f"{name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_long_function_without_a_reason():
    found = [
        hit
        for top in PRODUCT
        for f in sorted((REPO / top).rglob("*.py"))
        for hit in long_functions(f.read_text(), str(f.relative_to(REPO)))
    ]
    assert not found, (
        f"functions over {MAX_LINES} lines: split them into named phases, or say why one "
        "stays long (`# long: <reason>` on its def line or the line above):\n" + "\n".join(found)
    )


def _function(lines: int, comment: str = "", decorated: bool = False) -> str:
    head = (f"{comment}\n" if comment else "") + ("@decorator\n" if decorated else "")
    return head + "def f():\n" + "    x = 1\n" * (lines - 2) + "    return x\n"


def test_a_planted_long_function_is_found():
    assert long_functions(_function(MAX_LINES), "m.py") == []
    assert long_functions(_function(MAX_LINES + 1), "m.py") == ["m.py:1 f (81 lines)"]
    method = "class C:\n" + "".join(f"    {ln}\n" for ln in _function(90).splitlines())
    assert long_functions(method, "m.py") == ["m.py:2 f (90 lines)"]


@pytest.mark.parametrize("decorated", [False, True])
def test_a_stated_reason_lets_a_function_stay_long(decorated):
    said = _function(90, "# long: one table, read top to bottom", decorated)
    assert long_functions(said, "m.py") == []
    assert long_functions(_function(90, "# long:", decorated), "m.py") != []  # no reason given
    inline = _function(90).replace("def f():", "def f():  # long: a state machine")
    assert long_functions(inline, "m.py") == []
