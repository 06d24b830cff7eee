"""The database driver's errors, for the layers that must not import the driver itself.

The engine, the worker and the scanners catch these; only ``cyclone_dsl.db``
and ``cyclone_dsl.migrate`` import psycopg (a ruff banned-api rule holds this).
"""

from __future__ import annotations

import psycopg

#: The base class of every error the database driver raises.
DatabaseError = psycopg.Error
#: A lost connection, a server that went away mid-statement, a deadlock or a
#: serialization failure (the SQLSTATE says which).
ConnectionFailure = psycopg.OperationalError
#: A unique index refused a row (a submit key or unique key taken meanwhile).
UniqueViolation = psycopg.errors.UniqueViolation

__all__ = ["ConnectionFailure", "DatabaseError", "UniqueViolation"]
