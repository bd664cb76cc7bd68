"""The docs are tested: their `nodeforge …` commands parse, their links resolve, their tables
render, and the params table matches the parser.

A command in a fenced code block, or in an inline code span of the prose (`nodeforge node
status --json`), is checked against the real CLI parser (nothing runs here; the docs' examples
run in test_docs_examples.py):
- a concrete command (no placeholder) must parse as a whole (`parse_args`);
- a template (`…`, `<x>`, `[--json]`, an upper-case metavariable such as `DIR`) must name a
  subcommand that exists, and every `--flag` in it must be one of that subcommand's options;
- an inline span names a command (`nodeforge verify`, `nodeforge gang`) and perhaps some of its
  options, not always a whole call: the command must exist and every `--flag` be one of its.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from nodeforge.cli import build_parser
from tests.helpers import REPO
from tests.unit.project.docs_support import (
    DOCS,
    SHELL_FENCES,
    DocCommand,
    doc_commands,
    md,
    subparser,
)

pytestmark = pytest.mark.unit

COMMANDS = doc_commands()


def test_the_docs_hold_the_commands_we_check():
    """The extraction itself: a docs test that finds nothing proves nothing."""
    concrete = [c for c in COMMANDS if not c.template]
    inline = [c for c in COMMANDS if c.inline]
    assert len(COMMANDS) >= 100 and len(concrete) >= 80 and len(inline) >= 60, (
        len(COMMANDS),
        len(concrete),
        len(inline),
    )
    subcommands = {c.argv[0] for c in COMMANDS if c.argv}
    assert {"build", "versions", "params", "node", "cluster", "verify", "gang"} <= subcommands, (
        subcommands
    )


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_parses(cmd: DocCommand):
    parser = build_parser()
    sub, path = subparser(parser, cmd.argv)
    if not path and cmd.inline and all(a.startswith("-") for a in cmd.argv):
        flags = [a for a in cmd.argv if a not in parser._option_string_actions]
        assert not flags, f"{cmd.where}: `{cmd.text}`: nodeforge has no option {flags}"
        return  # `nodeforge --version`
    if not path and cmd.inline and cmd.template:
        return  # `nodeforge … | head`: any command
    assert path, f"{cmd.where}: `{cmd.text}` names no nodeforge subcommand"
    if sub._subparsers is not None and any(
        isinstance(a, argparse._SubParsersAction) and a.required for a in sub._actions
    ):
        if cmd.inline and len(cmd.argv) == len(path):
            return  # the prose names a command group (`nodeforge gang`)
        pytest.fail(f"{cmd.where}: `{cmd.text}`: `nodeforge {' '.join(path)}` needs a subcommand")
    known = set(sub._option_string_actions) | set(parser._option_string_actions)
    ours = (
        cmd.argv[: cmd.argv.index("--")] if "--" in cmd.argv else cmd.argv
    )  # then another program's
    flags = [a.split("=", 1)[0] for a in ours if a.startswith("--")]
    unknown = [f for f in flags if f not in known]
    assert not unknown, (
        f"{cmd.where}: `{cmd.text}`: `nodeforge {' '.join(path)}` has no option "
        f"{', '.join(unknown)} (it has {', '.join(sorted(o for o in known if o.startswith('--')))})"
    )
    if cmd.template or cmd.inline:
        return  # prose names a command and some of its options, not always a whole call
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(list(cmd.argv))
        except SystemExit as exc:
            assert exc.code in (0, None), (
                f"{cmd.where}: `{cmd.text}` does not parse:\n{err.getvalue()}"
            )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(f: Path) -> set[str]:
    toks = md().parse(f.read_text())
    out: set[str] = set()
    for i, t in enumerate(toks):
        if t.type == "heading_open":
            base = _slug(toks[i + 1].content)
            slug, n = base, 1
            while slug in out:
                slug, n = f"{base}-{n}", n + 1
            out.add(slug)
    return out


def _links(f: Path) -> list[tuple[int, str]]:
    out = []
    for t in md().parse(f.read_text()):
        for child in t.children or []:
            if child.type == "link_open":
                out.append(((t.map or [0])[0] + 1, str(child.attrs.get("href", ""))))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_internal_links_resolve(doc: Path):
    bad = []
    for line, href in _links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", href):  # https:, mailto: … (never fetched here)
            continue
        target, _, anchor = href.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            bad.append(f"{doc.relative_to(REPO)}:{line}: {href}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            bad.append(f"{doc.relative_to(REPO)}:{line}: {href}: no heading with that anchor")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_tables_are_not_broken(doc: Path):
    """A blank line inside a table ends it: the rows after it render as a paragraph of pipes."""
    toks = md().parse(doc.read_text())
    bad = [
        f"{doc.relative_to(REPO)}:{(t.map or [0])[0] + 1}: {t.content[:60]!r}"
        for i, t in enumerate(toks)
        if t.type == "inline"
        and i > 0
        and toks[i - 1].type == "paragraph_open"
        and t.content.lstrip().startswith("|")
    ]
    assert not bad, "table rows outside a table (a blank line split it?):\n" + "\n".join(bad)


def test_markdown_lint_tables_and_fragments():
    """A maintained Markdown linter (pymarkdownlnt) on the table and link rules."""
    from pymarkdown.api import PyMarkdownApi

    keep = {"md011", "md042", "md051", "md055", "md056", "md058"}
    failures = []
    for doc in DOCS:
        result = PyMarkdownApi().scan_path(str(doc))
        failures += [
            f"{doc.relative_to(REPO)}:{x.line_number}: {x.rule_id} {x.rule_name}"
            f"{x.extra_error_information or ''}"
            for x in result.scan_failures
            if x.rule_id.lower() in keep
        ]
    assert not failures, "\n".join(failures)


def _table_rows(doc: Path, header: str) -> list[str]:
    lines = doc.read_text().splitlines()
    start = lines.index(header)
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    return rows


def test_params_table_lists_every_key_once():
    """docs/agent.md's params table and the parser's keys are the same set, each row once."""
    from nodeforge.bootstrap import params

    rows = _table_rows(REPO / "docs/agent.md", "| field | type (full match) | default | meaning |")
    named: list[str] = []
    for r in rows:
        named += re.findall(r"`([a-z0-9_]+)`", r.split("|")[1])
    dup = sorted({k for k in named if named.count(k) > 1})
    assert not dup, f"params table lists these keys twice: {dup}"
    assert set(named) == set(params._TOP), (
        f"undocumented keys: {sorted(set(params._TOP) - set(named))}; "
        f"documented but unknown: {sorted(set(named) - set(params._TOP))}"
    )


def test_sinfo_reason_commands_show_the_whole_reason():
    """`sinfo -R` prints REASON in 20 characters: `nodeforge: hook 20-s`. Every `sinfo -R` the
    docs tell a user to run widens it (`-o '%100E …'`, at least 60)."""
    cmds = []
    for f in DOCS:
        for tok in md().parse(f.read_text()):
            if tok.type != "fence" or tok.info.strip().split(" ")[0] not in SHELL_FENCES:
                continue
            cmds += [(f, ln) for ln in tok.content.splitlines() if re.search(r"\bsinfo -R\b", ln)]
    assert cmds, "the docs show no sinfo -R command: this test checks nothing"
    narrow = [
        f"{f.relative_to(REPO)}: {ln.strip()}"
        for f, ln in cmds
        if not any(int(w) >= 60 for w in re.findall(r"%(\d+)E", ln))
    ]
    assert not narrow, "\n".join(narrow)
