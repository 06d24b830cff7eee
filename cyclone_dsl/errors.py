"""The typed errors Cyclone raises.

Every error a caller can act on has its own class; all derive from
:class:`CycloneError`::

    CycloneError
    ├── InvalidGraph            a workflow definition breaks a rule (lists all problems)
    ├── InvalidArgument         a bad option or value at an API boundary (also a ValueError)
    │   ├── InvalidPayload      a value that is not strict JSON (names the JSON path)
    │   ├── PayloadTooLarge     a payload over the configured byte limit
    │   └── ScheduleError       a bad cron spec, location or schedule id
    ├── UnknownDefinition       a name this process has not registered
    │   ├── UnknownWorkflow     a workflow
    │   └── UnknownKind         a step or action kind
    ├── RegistryConflict        two different objects registered under one name
    ├── RunNotFound             no run with that id
    ├── NodeNotFound            no node with that id in the run
    ├── AlreadyTerminal         the run has already completed, failed or been cancelled
    │   └── PassedDeadline      a signal or pause after the run's (or a parent's) deadline
    ├── InvalidTransition       the operation does not apply to the run's current state
    ├── MailboxFull             a signal over the wait's mailbox capacity
    ├── EventLimitExceeded      a step emitted more events than the per-step cap
    ├── SignalNotDeliverable    a signal whose wait has already completed, or an unknown name
    ├── NoOutput                the workflow defines no result node
    ├── RunFailed               a run ended failed or cancelled while a result was awaited
    ├── SubmitContended         a unique or submit key kept changing hands; try again
    ├── HandlerConflict         a live worker serves one of this worker's kinds with other code
    ├── WorkerCrashed           a worker's internal thread failed; the worker stopped
    ├── DatabaseUnavailable     the database cannot be reached or refused the session (cause)
    ├── SchemaVersionMismatch   the database is migrated past what this build knows, or not migrated
    ├── MigrationError          a migration file set or a migration failed
    │   ├── MigrationLockTimeout  the migration lock, or a migration's tables, held too long
    │   └── MigrationPermissionDenied  the database role may not make a schema change
    ├── EmbeddedServerError     the embedded PostgreSQL could not be started
    ├── ClientClosed            a call on a client that was closed
    ├── Permanent               raised by a handler: fail now, skip the remaining attempts
    └── BuildTimeValue          a builder used a reference's value (also a TypeError)
"""

from __future__ import annotations

from collections.abc import Sequence


class CycloneError(Exception):
    """Base class of every error Cyclone raises on purpose."""


class InvalidGraph(CycloneError):
    """A workflow definition breaks one or more rules.

    ``problems`` holds one message per problem; ``node_ids`` the ids of the
    nodes involved, in the order the problems were found.
    """

    def __init__(self, workflow: str, problems: Sequence[tuple[str | None, str]]) -> None:
        self.workflow = workflow
        self.problems: tuple[str, ...] = tuple(msg for _, msg in problems)
        self.node_ids: tuple[str, ...] = tuple(
            dict.fromkeys(node for node, _ in problems if node is not None)
        )
        lines = "\n".join(
            f"  - {msg}" if node is None else f"  - [{_shown(node)}] {msg}"
            for node, msg in problems
        )
        super().__init__(f"workflow {workflow!r} is invalid:\n{lines}")


def _shown(node: object) -> str:
    """A node id as a message shows it: as written, or quoted when it holds characters a
    log line cannot carry (a NUL, a lone surrogate: a log written as UTF-8 fails on it)."""
    return node if isinstance(node, str) and node.isprintable() else repr(node)


class InvalidArgument(CycloneError, ValueError):
    """A bad option or value at an API boundary; nothing was written."""


class InvalidPayload(InvalidArgument):
    """A value that cannot be stored as strict JSON.

    ``path`` is the JSON path of the offending value (``$.items[3].name``).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"invalid payload at {path}: {reason}")


class PayloadTooLarge(InvalidArgument):
    """A payload larger than the configured byte limit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(f"{what} is {size} bytes, over the limit of {limit} bytes")


class UnknownDefinition(CycloneError, LookupError):
    """A workflow or handler kind that this process has not registered."""


class UnknownWorkflow(UnknownDefinition):
    """A workflow that this process has not registered (or an object that is not one)."""


class UnknownKind(UnknownDefinition):
    """A step or action kind that this process has not registered (or an object that is not
    one)."""


class RegistryConflict(CycloneError):
    """Two different objects were registered under the same name."""


class RunNotFound(CycloneError, LookupError):
    """No run exists with the given id."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id} does not exist")


class NodeNotFound(CycloneError, LookupError):
    """The run has no node with the given id."""

    def __init__(self, run_id: int, node: str) -> None:
        self.run_id = run_id
        self.node = node
        super().__init__(f"run {run_id} has no node {node!r}")


class AlreadyTerminal(CycloneError):
    """The run has already completed, failed or been cancelled."""

    def __init__(self, run_id: int, state: str, why: str = "") -> None:
        self.run_id = run_id
        self.state = state
        super().__init__(f"run {run_id} is already {state}" + (f": {why}" if why else ""))


class PassedDeadline(AlreadyTerminal):
    """The run, or a parent run above it, passed its deadline before this call: it has
    ended there (the call records that end if no scanner had yet). Raised by a signal or
    a pause that comes too late; ``deadline_run_id`` is the run whose deadline passed."""

    def __init__(self, run_id: int, deadline_run_id: int) -> None:
        self.deadline_run_id = deadline_run_id
        if deadline_run_id == run_id:
            super().__init__(run_id, "failed", "it passed its deadline")
        else:
            super().__init__(
                run_id, "cancelled", f"its parent run {deadline_run_id} passed its deadline"
            )


class InvalidTransition(CycloneError):
    """The operation does not apply to the current state of the run or node."""


class MailboxFull(CycloneError):
    """The signal would exceed the mailbox capacity of its wait."""

    def __init__(self, run_id: int, name: str, capacity: int) -> None:
        self.run_id = run_id
        self.name = name
        self.capacity = capacity
        super().__init__(
            f"run {run_id}: the mailbox of signal {name!r} is full (capacity {capacity})"
        )


class EventLimitExceeded(CycloneError):
    """A step tried to store more events (``ctx.emit``, ``ctx.progress``) than its cap.

    The cap counts every event of the step, across its attempts; the event that hit it
    was not stored. A handler may catch this and go on without reporting more.
    """

    def __init__(self, run_id: int, node: str, cap: int) -> None:
        self.run_id = run_id
        self.node = node
        self.cap = cap
        super().__init__(
            f"run {run_id}: step {node!r} reached its cap of {cap} events; "
            "this event was not stored"
        )


class SignalNotDeliverable(CycloneError):
    """The signal cannot be delivered: its wait already completed, or no wait declares it."""


class NoOutput(CycloneError):
    """The run has no result: its workflow defines no result node, or the run completed
    with its result node cut off by a contained failure (``cancel_branch``)."""


class RunFailed(CycloneError):
    """A run ended ``failed`` or ``cancelled`` while its result was awaited.

    ``error`` and ``error_kind`` say what ended it, and ``node`` where: the step whose
    failure failed the run, else the run's own end (``deadline``, ``cancelled``), with the
    first step that end cancelled. A failure the run contained earlier is not its cause.
    """

    def __init__(
        self,
        run_id: int,
        state: str,
        node: str | None,
        error: str | None,
        error_kind: str | None,
    ) -> None:
        self.run_id = run_id
        self.state = state
        self.node = node
        self.error = error
        self.error_kind = error_kind
        where = f" at node {node!r}" if node else ""
        detail = f": {error}" if error else ""
        super().__init__(f"run {run_id} {state}{where}{detail}")


class SubmitContended(CycloneError):
    """A submit key or unique key kept changing hands while the submit looked for its holder.

    Each attempt found the key neither free nor held by a committed run (other
    callers kept inserting and rolling back). Nothing was written; trying again
    is safe.
    """


class HandlerConflict(CycloneError):
    """A live worker on this database serves a kind with a different handler.

    Two applications that share a database and both define ``@step def ship``
    would run each other's handlers; a worker refuses to start instead.
    ``conflicts`` holds ``(kind, this worker's handler, the other's handler,
    the other worker's id)`` for each kind.
    """

    def __init__(self, conflicts: Sequence[tuple[str, str, str, str]]) -> None:
        self.conflicts = tuple(conflicts)
        found = "; ".join(
            f"kind {kind!r}: this worker has {mine}, live worker {who} has {theirs}"
            for kind, mine, theirs, who in self.conflicts
        )
        super().__init__(
            f"another application's worker runs other handlers under the same names ({found}):"
            " rename one application's steps (@step(name=...)) or give it its own schema"
            " (search_path); if a handler only moved to another module, stop the old workers"
            " first (see the versioning guide)"
        )


class WorkerCrashed(CycloneError):
    """An internal thread of a worker failed unexpectedly; the worker stopped.

    Leases it held were released (or expire and are reclaimed); the cause is
    chained as ``__cause__``.
    """


class SchemaVersionMismatch(CycloneError):
    """The database schema version does not match what this build expects."""


class MigrationError(CycloneError):
    """The migration files are inconsistent, or a migration failed."""


class MigrationLockTimeout(MigrationError):
    """Another session holds the migration lock for longer than the timeout."""


class MigrationPermissionDenied(MigrationError):
    """The database role lacks a privilege a migration needs (``CREATE`` on the schema,
    ownership of a table); what it could not do was rolled back.

    The message names the migration (or the version tables) and the database's refusal.
    Run the migrations as a role that owns the schema, or has ``CREATE`` on it.
    """


class EmbeddedServerError(CycloneError):
    """The embedded PostgreSQL server could not be started or stopped."""


class ScheduleError(InvalidArgument):
    """A bad cron spec, time zone or schedule id."""


class Permanent(CycloneError):
    """Raise from a handler to fail its step at once, without the remaining attempts."""


class BuildTimeValue(CycloneError, TypeError):
    """A ``@workflow`` builder used the value of a reference, which it does not have.

    A builder runs once, to record the graph, not once per run: the run input
    and node outputs it sees are references. Formatting one (an f-string,
    ``str()``), testing it (``if``, ``==``, ``<``), iterating, indexing,
    converting, doing arithmetic with it or reading an attribute of it would
    freeze a placeholder into the graph, so it raises this instead. Pass the
    reference to a step and do the work inside the step, where it is the
    real value.
    """


class ClientClosed(CycloneError):
    """The client was closed (``close()``, or the end of its ``with`` block): open a new one."""


class DatabaseUnavailable(CycloneError):
    """The database cannot be reached, or refused the session.

    ``cause`` says why, as a short string: ``unknown_host``, ``connection_refused``,
    ``timeout``, ``database_missing``, ``authentication_failed``,
    ``too_many_connections``, ``server_starting_or_stopping``, ``unsupported_parameter``
    (a transaction-mode pooler given without ``pooled=True``), ``connection_lost``,
    ``pool_exhausted``, ``permission_denied`` (the role may not read Cyclone's tables),
    ``read_only`` (a standby, or a role or database with ``default_transaction_read_only``:
    a worker refuses it at its start, a client's write raises it) or ``other``. The message
    names the server (never the password) and what to check.
    """

    def __init__(self, message: str, cause: str) -> None:
        self.cause = cause
        super().__init__(message)
