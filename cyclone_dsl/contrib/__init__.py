"""Integrations with web frameworks, each an optional extra.

- :mod:`cyclone_dsl.contrib.fastapi` (``pip install 'cyclone-dsl[fastapi]'``): a lifespan
  that opens an :class:`~cyclone_dsl.AsyncClient`, a dependency that hands it to request
  handlers, and a server-sent-events stream of a run's status.
- :mod:`cyclone_dsl.contrib.django` (``pip install 'cyclone-dsl[django]'``): a Django app
  with settings-driven configuration, ``submit_tx`` in the current ``atomic()`` block and
  the ``cyclone_worker`` management command.
- :mod:`cyclone_dsl.contrib.sqlalchemy` (``pip install 'cyclone-dsl[sqlalchemy]'``):
  ``submit_tx`` and its siblings in a ``Session``'s transaction.

Importing :mod:`cyclone_dsl` imports none of the frameworks; each module here imports
only its own, and says which extra to install when it is missing.
"""

from __future__ import annotations


def missing_extra(integration: str, framework: str, extra: str) -> ImportError:
    """The error to raise (``from`` the original) when a framework is not installed."""
    return ImportError(
        f"cyclone_dsl.contrib.{integration} needs {framework}: pip install 'cyclone-dsl[{extra}]'"
    )
