"""Parses the named-query ``.sql`` files shipped beside this module.

A file holds queries, each opened by a header line ``-- name: verb_object``
followed by an optional comment line describing it. Placeholders are
psycopg's named ``%(name)s``, and ``%(name)b`` for arrays (sent in binary format,
which psycopg dumps without escaping each element in Python). Names are unique
across all files.

A block opened by ``-- fragment: name`` is not a query but a piece of SQL that
queries of any file include with ``{{name}}`` (an expression two queries share).
"""

from __future__ import annotations

import re
from importlib import resources

_HEADER = re.compile(r"^--\s*(name|fragment):\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_INCLUDE = re.compile(r"\{\{([a-z_][a-z0-9_]*)\}\}")


def load_queries(package: str) -> dict[str, str]:
    """Every named query in the ``.sql`` files of ``package``, by name, fragments included."""
    queries: dict[str, str] = {}
    fragments: dict[str, str] = {}
    files = sorted(
        (entry for entry in resources.files(package).iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )
    for entry in files:
        text = entry.read_text(encoding="utf-8")
        headers = list(_HEADER.finditer(text))
        for header, following in zip(headers, [*headers[1:], None], strict=True):
            what, name = header.group(1), header.group(2)
            end = following.start() if following is not None else len(text)
            body = text[header.end() : end].strip()
            if name in queries or name in fragments:
                raise RuntimeError(f"{what} {name!r} is defined twice ({entry.name})")
            if not body:
                raise RuntimeError(f"{what} {name!r} in {entry.name} is empty")
            (queries if what == "name" else fragments)[name] = body
    return {name: _compact(_include(body, fragments)) for name, body in queries.items()}


def _compact(body: str) -> str:
    """``body`` without its comments, indentation, blank lines and runs of spaces.

    The comments are for readers of the ``.sql`` files. Sent with every statement they
    made the claim longer than psycopg caches the conversion of (4 kB): each claim parsed
    its text again in Python, and a pooled connection, which prepares nothing, sends the
    whole text on every execution. Quoted text is kept as it is.
    """
    lines = []
    for line in _strip_comments(body).splitlines():
        if line.strip():
            lines.append(line.strip())
    return "\n".join(lines)


#: What :func:`_strip_comments` looks at, leftmost first: a quoted string or identifier
#: (kept whole; a doubled quote inside it is one character), a comment, a quote left
#: open, a run of spaces.
_LEXEME = re.compile(r"""('(?:[^']|'')*'|"(?:[^"]|"")*")|(--[^\n]*)|(['"])|(  +)""")


def _strip_comments(body: str) -> str:
    """``body`` with each ``--`` comment removed up to its line's end and each run of spaces
    made one (not inside quotes)."""

    def replace(match: re.Match[str]) -> str:
        quoted, comment, open_quote, _spaces = match.groups()
        if quoted is not None:
            return quoted
        if open_quote is not None:
            at = match.start()
            raise RuntimeError(f"unterminated quote in query: {body[at : at + 40]!r}")
        return "" if comment is not None else " "

    return _LEXEME.sub(replace, body)


def _include(body: str, fragments: dict[str, str], depth: int = 0) -> str:
    """``body`` with its fragments included (fragments may include fragments)."""
    if depth > 8:
        raise RuntimeError("fragments include each other in a loop")

    def fragment(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in fragments:
            raise RuntimeError(f"unknown fragment {{{{{name}}}}}")
        return _include(fragments[name], fragments, depth + 1)

    return _INCLUDE.sub(fragment, body)
