"""Cyclone: durable workflows for Python whose only infrastructure is PostgreSQL."""

from cyclone_dsl._version import __version__
from cyclone_dsl.client.aio import AsyncClient, AsyncRunHandle
from cyclone_dsl.client.bulk import BulkResult
from cyclone_dsl.client.handle import RunHandle
from cyclone_dsl.client.model import Attempt, Run, Step, StepEvent
from cyclone_dsl.client.sync import Client
from cyclone_dsl.db.embedded import EmbeddedServer, embedded_database
from cyclone_dsl.dsl.builder import NodeRef, Ref
from cyclone_dsl.dsl.compose import child, define_result, for_each
from cyclone_dsl.dsl.flow import Concurrency, Debounce, RateLimit
from cyclone_dsl.dsl.registry import Registry
from cyclone_dsl.dsl.schedule import schedule
from cyclone_dsl.dsl.step import StepDef, action, step
from cyclone_dsl.dsl.waits import wait_any, wait_n, wait_signal, wait_timer
from cyclone_dsl.dsl.workflow import WorkflowDef, workflow
from cyclone_dsl.engine.bulk import RunFilter
from cyclone_dsl.engine.signals import Delivery
from cyclone_dsl.errors import (
    AlreadyTerminal,
    BuildTimeValue,
    ClientClosed,
    CycloneError,
    DatabaseUnavailable,
    EmbeddedServerError,
    EventLimitExceeded,
    HandlerConflict,
    InvalidArgument,
    InvalidGraph,
    InvalidPayload,
    InvalidTransition,
    MailboxFull,
    MigrationError,
    MigrationLockTimeout,
    MigrationPermissionDenied,
    NodeNotFound,
    NoOutput,
    PassedDeadline,
    PayloadTooLarge,
    Permanent,
    RegistryConflict,
    RunFailed,
    RunNotFound,
    ScheduleError,
    SchemaVersionMismatch,
    SignalNotDeliverable,
    SubmitContended,
    UnknownDefinition,
    UnknownKind,
    UnknownWorkflow,
    WorkerCrashed,
)
from cyclone_dsl.graph.conditions import Condition
from cyclone_dsl.migrate import (
    EXTENSION_VERSION_TABLE,
    LATEST_EXTENSION_VERSION,
    LATEST_SCHEMA_VERSION,
    SCHEMA_VERSION_TABLE,
    migrate,
    migrate_versions,
)
from cyclone_dsl.states import RunState, StepState
from cyclone_dsl.worker.context import StepContext
from cyclone_dsl.worker.worker import Worker

__all__ = [
    "EXTENSION_VERSION_TABLE",
    "LATEST_EXTENSION_VERSION",
    "LATEST_SCHEMA_VERSION",
    "SCHEMA_VERSION_TABLE",
    "AlreadyTerminal",
    "AsyncClient",
    "AsyncRunHandle",
    "Attempt",
    "BuildTimeValue",
    "BulkResult",
    "Client",
    "ClientClosed",
    "Concurrency",
    "Condition",
    "CycloneError",
    "DatabaseUnavailable",
    "Debounce",
    "Delivery",
    "EmbeddedServer",
    "EmbeddedServerError",
    "EventLimitExceeded",
    "HandlerConflict",
    "InvalidArgument",
    "InvalidGraph",
    "InvalidPayload",
    "InvalidTransition",
    "MailboxFull",
    "MigrationError",
    "MigrationLockTimeout",
    "MigrationPermissionDenied",
    "NoOutput",
    "NodeNotFound",
    "NodeRef",
    "PassedDeadline",
    "PayloadTooLarge",
    "Permanent",
    "RateLimit",
    "Ref",
    "Registry",
    "RegistryConflict",
    "Run",
    "RunFailed",
    "RunFilter",
    "RunHandle",
    "RunNotFound",
    "RunState",
    "ScheduleError",
    "SchemaVersionMismatch",
    "SignalNotDeliverable",
    "Step",
    "StepContext",
    "StepDef",
    "StepEvent",
    "StepState",
    "SubmitContended",
    "UnknownDefinition",
    "UnknownKind",
    "UnknownWorkflow",
    "Worker",
    "WorkerCrashed",
    "WorkflowDef",
    "__version__",
    "action",
    "child",
    "define_result",
    "embedded_database",
    "for_each",
    "migrate",
    "migrate_versions",
    "schedule",
    "step",
    "wait_any",
    "wait_n",
    "wait_signal",
    "wait_timer",
    "workflow",
]
