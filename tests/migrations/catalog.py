"""Reads a schema's catalog into plain data comparable with expected_schema."""

from __future__ import annotations

from typing import Any

import psycopg


def read_catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    cur = conn.cursor()
    columns: dict[str, list[tuple[str, str, bool]]] = {}
    defaults: dict[tuple[str, str], str] = {}
    for table, name, dtype, nullable, default in cur.execute(
        """SELECT c.table_name, c.column_name, c.data_type, c.is_nullable = 'YES', c.column_default
           FROM information_schema.columns c
           JOIN information_schema.tables t
             ON t.table_schema = c.table_schema AND t.table_name = c.table_name
           WHERE c.table_schema = %s AND t.table_type = 'BASE TABLE'
           ORDER BY c.table_name, c.ordinal_position""",
        (schema,),
    ):
        columns.setdefault(table, []).append((name, dtype, nullable))
        if default is not None:
            defaults[(table, name)] = default
    constraints: dict[str, tuple[str, str, str]] = {}
    foreign_keys = set()
    primary_keys: dict[str, list[str]] = {}
    for name, ctype, table, definition, ref_table, cols, ref_cols, on_delete in cur.execute(
        """SELECT con.conname, con.contype, rel.relname, pg_get_constraintdef(con.oid),
                  frel.relname,
                  ARRAY(SELECT a.attname FROM unnest(con.conkey) WITH ORDINALITY k(n, o)
                        JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
                        ORDER BY k.o),
                  ARRAY(SELECT a.attname FROM unnest(con.confkey) WITH ORDINALITY k(n, o)
                        JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n
                        ORDER BY k.o),
                  con.confdeltype
           FROM pg_constraint con
           JOIN pg_class rel ON rel.oid = con.conrelid
           JOIN pg_namespace ns ON ns.oid = rel.relnamespace
           LEFT JOIN pg_class frel ON frel.oid = con.confrelid
           WHERE ns.nspname = %s""",
        (schema,),
    ):
        constraints[name] = (ctype, table, definition)
        if ctype == "f":
            foreign_keys.add((table, tuple(cols), ref_table, tuple(ref_cols), on_delete))
        if ctype == "p":
            primary_keys[table] = list(cols)
    indexes = {
        name: (table, definition.replace(f"{schema}.", ""))
        for name, table, definition in cur.execute(
            "SELECT indexname, tablename, indexdef FROM pg_indexes WHERE schemaname = %s",
            (schema,),
        )
    }
    views: dict[str, set[str]] = {}
    for view, column in cur.execute(
        """SELECT c.table_name, c.column_name FROM information_schema.columns c
           JOIN information_schema.views v
             ON v.table_schema = c.table_schema AND v.table_name = c.table_name
           WHERE c.table_schema = %s""",
        (schema,),
    ):
        views.setdefault(view, set()).add(column)
    return {
        "columns": columns,
        "defaults": defaults,
        "constraints": constraints,
        "foreign_keys": foreign_keys,
        "primary_keys": primary_keys,
        "indexes": indexes,
        "views": views,
    }
