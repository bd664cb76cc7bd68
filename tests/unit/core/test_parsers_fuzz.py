"""Fuzz tier (bounded): every parser of outside input, against hostile generated input.

The targets live in bench/fuzz_parsers.py (the bench runs them longer, `--examples N`). The
invariant: no traceback; a valid result, or the parser's own error naming its source (and
then the field or line). Budget: a fixed number of examples per parser, no deadline (a
shared CI machine), about a second per parser.
"""

from __future__ import annotations

import pytest

from bench import fuzz_parsers

pytestmark = pytest.mark.unit

EXAMPLES = 120


@pytest.mark.parametrize("name", sorted(fuzz_parsers.TARGETS))
def test_parser_never_tracebacks(name, tmp_path):
    res = fuzz_parsers.run(name, EXAMPLES, tmp_path)
    assert not res.failures, "\n\n".join(res.failures)
    assert res.cases >= EXAMPLES  # the property ran, not a skipped or filtered-out strategy


def test_invariant_check_catches_an_escaping_exception(tmp_path, monkeypatch):
    """The harness itself: a parser that raises a bare exception, or an error that does not
    name its source, is a failure (so a green run means something)."""
    from hypothesis import strategies as st

    def broken(work):
        def check(text):
            if len(text) > 2:
                raise RecursionError("maximum recursion depth exceeded")
            fuzz_parsers.expect(
                lambda: (_ for _ in ()).throw(ValueError("no source named")),
                (ValueError,),
                "node.yaml",
            )

        return st.text(max_size=5), check

    monkeypatch.setitem(fuzz_parsers.TARGETS, "broken", broken)
    res = fuzz_parsers.run("broken", 50, tmp_path)
    assert res.failures
    assert any("does not name" in f or "RecursionError escaped" in f for f in res.failures)
