"""Observability: structured logs with step context, Prometheus metrics (``metrics`` extra).

:func:`configure_logging` and :class:`StepContextFilter` need nothing but the standard
library; :mod:`cyclone_dsl.observability.metrics` imports ``prometheus_client`` and is
only imported when metrics are asked for.
"""

from cyclone_dsl.observability.logs import (
    CONTEXT_FIELDS,
    JsonFormatter,
    StepContextFilter,
    configure_logging,
    step_fields,
)

__all__ = [
    "CONTEXT_FIELDS",
    "JsonFormatter",
    "StepContextFilter",
    "configure_logging",
    "step_fields",
]
