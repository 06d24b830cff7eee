"""The engine core: the only writer of state transitions.

Other layers use :class:`Engine` and the value types re-exported here, never
the modules behind them (an import-linter contract holds this). Every
transition runs inside a transaction the caller opened (a
:class:`~cyclone_dsl.db.tx.Tx`), locks run rows before step rows (runs in id
order, then steps in id order) and guards every step write with the state and
``lease_generation`` it expects, so a stale worker or a racing scanner changes
nothing.
"""

from cyclone_dsl.engine.backoff import backoff_seconds
from cyclone_dsl.engine.bulk import (
    DEFAULT_BATCH_SIZE,
    MAX_BATCH_SIZE,
    BulkAction,
    BulkPage,
    RunFilter,
)
from cyclone_dsl.engine.children import CHILD_WAKE
from cyclone_dsl.engine.claim import Claimed
from cyclone_dsl.engine.complete import Failure, Success
from cyclone_dsl.engine.core import (
    DEFAULT_MAX_RECLAIMS,
    DEFAULT_RETENTION,
    Engine,
    Page,
    Refused,
)
from cyclone_dsl.engine.events import (
    DEFAULT_MAX_EVENTS_PER_STEP,
    EVENT_KINDS,
    NewEvent,
    Outcome,
    Recorded,
)
from cyclone_dsl.engine.notify import (
    CANCEL_CHANNEL,
    EVENTS_CHANNEL,
    RUN_DONE_CHANNEL,
    WORK_CHANNEL,
    AfterCommit,
    names_run,
    run_ids_of,
)
from cyclone_dsl.engine.scan import (
    PROBED_PASSES,
    TIMEOUT_GRACE,
    retention_look_every,
)
from cyclone_dsl.engine.schedules import CatchUp
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.engine.submit import Submitted, TemplateRun, template_fits
from cyclone_dsl.engine.tracecontext import Carrier, TraceHook
from cyclone_dsl.engine.workers import LIVE_FOR

__all__ = [
    "CANCEL_CHANNEL",
    "CHILD_WAKE",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_EVENTS_PER_STEP",
    "DEFAULT_MAX_RECLAIMS",
    "DEFAULT_RETENTION",
    "EVENTS_CHANNEL",
    "EVENT_KINDS",
    "LIVE_FOR",
    "MAX_BATCH_SIZE",
    "PROBED_PASSES",
    "RUN_DONE_CHANNEL",
    "TIMEOUT_GRACE",
    "WORK_CHANNEL",
    "AfterCommit",
    "BulkAction",
    "BulkPage",
    "Carrier",
    "CatchUp",
    "Claimed",
    "Delivery",
    "Engine",
    "Failure",
    "NewEvent",
    "Outcome",
    "Page",
    "Recorded",
    "Refused",
    "RunFilter",
    "Submitted",
    "Success",
    "TemplateRun",
    "TraceHook",
    "backoff_seconds",
    "names_run",
    "retention_look_every",
    "run_ids_of",
    "template_fits",
]
