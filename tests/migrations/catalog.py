"""Reads one schema's catalog into plain data, in the shape of ``expected_schema.expected_at``,
and lists the differences between two such catalogs.

The catalog is::

    {"tables": {table: {"columns": [(name, type, nullable, default, identity), ...],
                        "constraints": {name: (type letter, definition, validated)},
                        "indexes": {name: (unique, keys, predicate or None)},
                        "options": {reloption: value}}},
     "views": {view: [(column, type), ...]},
     "view_sql": {view: definition},          # only with definitions=True
     "others": [(relkind, name), ...]}        # relations that are none of the above

Indexes that back a primary key or unique constraint are reported as constraints, not as
indexes. Expressions are normalised by :func:`plain`.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

_IDENTITY = {"a": "always", "d": "by default"}
_KEYWORDS = {"AND", "OR", "NOT", "CHECK", "WHERE"}

_COLUMNS = """
SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull,
       pg_get_expr(d.adbin, d.adrelid), a.attidentity
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef AS d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v')
ORDER BY c.relname, a.attnum
"""

_RELATIONS = """
SELECT c.relname, c.relkind, coalesce(c.reloptions, '{}'),
       CASE WHEN c.relkind = 'v' THEN pg_get_viewdef(c.oid) END
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %s
"""

_CONSTRAINTS = """
SELECT rel.relname, con.conname, con.contype, pg_get_constraintdef(con.oid), con.convalidated
FROM pg_constraint AS con
JOIN pg_class AS rel ON rel.oid = con.conrelid
JOIN pg_namespace AS n ON n.oid = rel.relnamespace
WHERE n.nspname = %s
"""

_INDEXES = """
SELECT t.relname, i.relname, x.indisunique, pg_get_indexdef(x.indexrelid),
       pg_get_expr(x.indpred, x.indrelid), x.indisvalid,
       EXISTS (SELECT 1 FROM pg_constraint AS con WHERE con.conindid = x.indexrelid
               AND con.contype IN ('p', 'u', 'x'))
FROM pg_index AS x
JOIN pg_class AS i ON i.oid = x.indexrelid
JOIN pg_class AS t ON t.oid = x.indrelid
JOIN pg_namespace AS n ON n.oid = t.relnamespace
WHERE n.nspname = %s
"""

_OTHER_OBJECTS = """
SELECT 'function', p.proname FROM pg_proc AS p
JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %(schema)s
UNION ALL
SELECT 'type', t.typname FROM pg_type AS t
JOIN pg_namespace AS n ON n.oid = t.typnamespace
WHERE n.nspname = %(schema)s AND t.typtype NOT IN ('c', 'b') AND t.typrelid = 0
UNION ALL
SELECT 'trigger', tg.tgname FROM pg_trigger AS tg
JOIN pg_class AS c ON c.oid = tg.tgrelid
JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND NOT tg.tgisinternal
"""


def plain(expr: str | None, schema: str = "") -> str | None:
    """An expression as PostgreSQL prints it, made comparable with hand-written text.

    Drops ``::text`` casts and the schema prefix, spells ``= ANY (ARRAY[...])`` as
    ``IN (...)`` and removes grouping parentheses (those of function calls and IN lists
    stay). Good for the simple predicates of this schema, not for arbitrary SQL.
    """
    if expr is None:
        return None
    if schema:
        expr = expr.replace(f"{schema}.", "")
    expr = expr.replace("::text[]", "").replace("::text", "")
    expr = re.sub(r"= ANY \(ARRAY\[(.*?)\]\)", r"IN (\1)", expr)
    out: list[str] = []
    kept: list[bool] = []
    for i, ch in enumerate(expr):
        if ch == "(":
            word = re.search(r"(\w+)\s*$", expr[:i])
            keep = word is not None and word.group(1).upper() not in _KEYWORDS
            kept.append(keep)
            if keep:
                out.append(ch)
        elif ch == ")":
            if kept.pop():
                out.append(ch)
        else:
            out.append(ch)
    return " ".join("".join(out).split())


def _index_keys(definition: str) -> str:
    head = definition.split(" WHERE ", 1)[0]
    match = re.search(r" USING \w+ \((.*)\)$", head)
    assert match is not None, definition
    return match.group(1)


def read_catalog(
    conn: psycopg.Connection[Any], schema: str, *, definitions: bool = False
) -> dict[str, Any]:
    """The catalog of ``schema`` (see the module docstring).

    ``definitions`` adds the views' SQL, to compare two catalogs with each other (the
    reference gives view columns only).
    """
    tables: dict[str, dict[str, Any]] = {}
    views: dict[str, list[tuple[str, str]]] = {}
    view_sql: dict[str, str] = {}
    others: list[tuple[str, str]] = []
    index_names: set[str] = set()
    for relname, relkind, options, viewdef in conn.execute(_RELATIONS, (schema,)):
        if relkind in ("r", "p"):
            tables[relname] = {
                "columns": [],
                "constraints": {},
                "indexes": {},
                "options": dict(o.split("=", 1) for o in options),
            }
        elif relkind == "v":
            views[relname] = []
            view_sql[relname] = " ".join(str(viewdef).replace(f"{schema}.", "").split())
        elif relkind == "i":
            index_names.add(relname)
        elif relkind != "S":  # sequences belong to identity columns
            others.append((str(relkind), relname))
    for relname, name, type_, nullable, default, identity in conn.execute(_COLUMNS, (schema,)):
        if relname in views:
            views[relname].append((name, type_))
        else:
            tables[relname]["columns"].append(
                (name, type_, nullable, plain(default, schema), _IDENTITY.get(identity))
            )
    for relname, name, contype, definition, validated in conn.execute(_CONSTRAINTS, (schema,)):
        definition = definition.replace(f"{schema}.", "").removesuffix(" NOT VALID")
        if contype == "c":
            definition = plain(definition.removeprefix("CHECK "), schema)
        tables[relname]["constraints"][name] = (contype, definition, validated)
    for table, name, unique, definition, predicate, valid, backs_constraint in conn.execute(
        _INDEXES, (schema,)
    ):
        index_names.discard(name)
        if backs_constraint:
            continue
        if not valid:
            others.append(("invalid index", name))
        tables[table]["indexes"][name] = (
            unique,
            _index_keys(definition),
            plain(predicate, schema),
        )
    others.extend(("index without table", name) for name in sorted(index_names))
    others.extend(
        (str(kind), str(name)) for kind, name in conn.execute(_OTHER_OBJECTS, {"schema": schema})
    )
    catalog: dict[str, Any] = {"tables": tables, "views": views, "others": sorted(others)}
    if definitions:
        catalog["view_sql"] = view_sql
    return catalog


def table_differences(expected: dict[str, Any] | None, actual: dict[str, Any] | None) -> list[str]:
    """Human-readable differences between two table entries (empty when equal)."""
    if expected is None or actual is None:
        return ["table missing" if actual is None else "table not expected"]
    problems: list[str] = []
    exp_cols = {c[0]: c for c in expected["columns"]}
    act_cols = {c[0]: c for c in actual["columns"]}
    labels = ("name", "type", "nullable", "default", "identity")
    for name in exp_cols.keys() - act_cols.keys():
        problems.append(f"column {name} missing")
    for name in act_cols.keys() - exp_cols.keys():
        problems.append(f"column {name} not expected: {act_cols[name]}")
    for name in exp_cols.keys() & act_cols.keys():
        for label, want, got in zip(labels, exp_cols[name], act_cols[name], strict=True):
            if want != got:
                problems.append(f"column {name}: {label} is {got!r}, expected {want!r}")
    exp_order = [c[0] for c in expected["columns"] if c[0] in act_cols]
    act_order = [c[0] for c in actual["columns"] if c[0] in exp_cols]
    if exp_order != act_order:
        problems.append(f"column order is {act_order}, expected {exp_order}")
    for kind, what in (("constraints", "constraint"), ("indexes", "index")):
        problems.extend(_dict_differences(what, expected[kind], actual[kind]))
    if expected["options"] != actual["options"]:
        problems.append(f"options are {actual['options']}, expected {expected['options']}")
    return problems


def _dict_differences(what: str, expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    problems = [f"{what} {name} missing: {expected[name]}" for name in expected.keys() - actual]
    problems += [f"{what} {name} not expected: {actual[name]}" for name in actual.keys() - expected]
    problems += [
        f"{what} {name} is {actual[name]}, expected {expected[name]}"
        for name in expected.keys() & actual.keys()
        if expected[name] != actual[name]
    ]
    return sorted(problems)


def catalog_differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Every difference between two whole catalogs, prefixed with the object's name."""
    problems: list[str] = []
    for table in sorted(expected["tables"].keys() | actual["tables"].keys()):
        problems += [
            f"{table}: {p}"
            for p in table_differences(expected["tables"].get(table), actual["tables"].get(table))
        ]
    for view in sorted(expected["views"].keys() | actual["views"].keys()):
        want, got = expected["views"].get(view), actual["views"].get(view)
        if want is None or got is None:
            problems.append(f"{view}: {'view missing' if got is None else 'view not expected'}")
        elif want != got:
            missing = [c for c in want if c not in got]
            extra = [c for c in got if c not in want]
            detail = f"missing {missing}, not expected {extra}" if missing or extra else "order"
            problems.append(f"{view}: columns differ ({detail})")
    if expected.get("others", []) != actual.get("others", []):
        problems.append(f"other objects: {actual.get('others')}, expected {expected.get('others')}")
    if "view_sql" in expected and "view_sql" in actual:
        for view in sorted(expected["view_sql"].keys() | actual["view_sql"].keys()):
            if expected["view_sql"].get(view) != actual["view_sql"].get(view):
                problems.append(f"{view}: definition differs")
    return problems
