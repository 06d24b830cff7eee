"""Parses the named-query ``.sql`` files shipped beside this module.

A file holds queries, each opened by a header line ``-- name: verb_object``
followed by an optional comment line describing it. Placeholders are
psycopg's named ``%(name)s``. Names are unique across all files.
"""

from __future__ import annotations

import re
from importlib import resources

_HEADER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def load_queries(package: str) -> dict[str, str]:
    """Every named query in the ``.sql`` files of ``package``, by name."""
    queries: dict[str, str] = {}
    files = sorted(
        (entry for entry in resources.files(package).iterdir() if entry.name.endswith(".sql")),
        key=lambda entry: entry.name,
    )
    for entry in files:
        text = entry.read_text(encoding="utf-8")
        headers = list(_HEADER.finditer(text))
        for header, following in zip(headers, [*headers[1:], None], strict=True):
            name = header.group(1)
            end = following.start() if following is not None else len(text)
            body = text[header.end() : end].strip()
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice ({entry.name})")
            if not body:
                raise RuntimeError(f"query {name!r} in {entry.name} is empty")
            queries[name] = body
    return queries
