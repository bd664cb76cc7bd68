"""The docs as the docs tests read them: the Markdown files, their fenced blocks, and the
`nodeforge …` commands in their code blocks and inline code spans (with the CLI parser they
name). Shared by test_docs.py and test_docs_examples.py, which import this, never each other."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

from tests.helpers import REPO

DOCS = sorted(
    {
        REPO / "README.md",
        *REPO.glob("docs/**/*.md"),
        *REPO.glob("extensions/**/*.md"),
        *REPO.glob("bench/*.md"),
    }
)
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
# Words before the program that do not change which program runs.
PREFIX_WORDS = {"sudo", "$SUDO", "env", "time", "exec", "nohup"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<&", ">|"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
METAVAR = re.compile(r"[A-Z][A-Z0-9_]*(?:[.,=:/][A-Z0-9_…]*)*")
ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def md() -> MarkdownIt:
    return MarkdownIt("commonmark").enable("table")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    argv: tuple[str, ...]  # after `nodeforge`
    text: str
    inline: bool = False  # an inline code span in the prose, not a code block

    @property
    def template(self) -> bool:
        for a in self.argv:
            if "…" in a or "..." in a or a.startswith(("<", "[", "{")) or "|" in a:
                return True
            if METAVAR.fullmatch(a.split("=", 1)[-1]):
                return True
        return False


def commands_in_line(line: str) -> list[list[str]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        tokens = list(lex)
    except ValueError:  # an unclosed quote: prose, not a command
        return []
    out: list[list[str]] = [[]]
    skip_next = False
    for t in tokens:
        if skip_next:
            skip_next = False
            continue
        if t in SEPARATORS:
            out.append([])
        elif t in REDIRECTS:
            if out[-1] and out[-1][-1].isdigit():
                out[-1].pop()  # the `2` of `2>&1`
            skip_next = True
        else:
            out[-1].append(t)
    return [c for c in out if c]


def nodeforge_argv(words: list[str]) -> list[str] | None:
    i = 0
    while i < len(words) and (words[i] in PREFIX_WORDS or ASSIGN.fullmatch(words[i])):
        i += 1
    prog = words[i] if i < len(words) else ""
    if prog in ("python", "python3") or prog.endswith(("/python", "/python3")):
        return words[i + 3 :] if words[i + 1 : i + 3] == ["-m", "nodeforge"] else None
    if prog == "nodeforge" or prog.endswith("/nodeforge"):
        return words[i + 1 :]
    return None


def doc_commands() -> list[DocCommand]:
    found: list[DocCommand] = []
    for f in DOCS:
        for tok in md().parse(f.read_text()):
            if tok.type == "inline":
                for span in tok.children or []:
                    words = commands_in_line(span.content) if span.type == "code_inline" else []
                    argv = nodeforge_argv(words[0]) if words else None
                    if argv:  # `nodeforge` alone is the name (a package, a section), not a call
                        where = f"{f.relative_to(REPO)}:{(tok.map or [0])[0] + 1}"
                        found.append(DocCommand(where, tuple(argv), span.content, inline=True))
            if tok.type != "fence" or tok.info.strip().split(" ")[0] not in SHELL_FENCES:
                continue
            start = (tok.map or [0])[0] + 2  # the fence line, then 1-based
            text = re.sub(r"\\\n\s*", " ", tok.content)  # line continuations
            for n, raw in enumerate(text.splitlines()):
                line = re.sub(r"^\s*[$#] (?=\S)", "", raw) if raw.lstrip().startswith("$ ") else raw
                for words in commands_in_line(line):
                    argv = nodeforge_argv(words)
                    if argv is not None:
                        where = f"{f.relative_to(REPO)}:{start + n}"
                        found.append(DocCommand(where, tuple(argv), raw.strip()))
    return found


def subparser(parser: argparse.ArgumentParser, argv: tuple[str, ...]):
    """The deepest subcommand parser that *argv* names, and the path to it."""
    path: list[str] = []
    for a in argv:
        if a.startswith("-"):
            continue
        subs = [x for x in parser._actions if isinstance(x, argparse._SubParsersAction)]
        if not subs or a not in subs[0].choices:
            break
        parser = subs[0].choices[a]
        path.append(a)
    return parser, path


def fences(doc: Path) -> list[tuple[str, str, int]]:
    """(info, content, 1-based line of the fence) of every fenced block in *doc*."""
    return [
        (t.info.strip(), t.content, (t.map or [0])[0] + 1)
        for t in md().parse(doc.read_text())
        if t.type == "fence"
    ]


def block(rel: str, marker: str) -> str:
    """The one fenced block of docs file *rel* whose text holds *marker*."""
    found = [c for _, c, _ in fences(REPO / rel) if marker in c]
    assert len(found) == 1, f"{rel}: {len(found)} blocks hold {marker!r}"
    return found[0]
