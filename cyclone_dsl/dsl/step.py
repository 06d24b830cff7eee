"""``@step`` and ``@action``: handlers that run on workers and nodes inside workflows.

``StepDef[P, R]`` keeps the handler's parameters ``P`` and return type ``R``;
how a call of it is typed (a plain call returning ``R``, or a builder call
returning ``NodeRef[...]``) is :class:`~cyclone_dsl.dsl.signatures.StepCalls`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, ParamSpec, TypeAlias, TypeVar, overload

import attrs
from typing_extensions import Unpack

from cyclone_dsl.dsl.builder import OPTION_NAMES, active_builder
from cyclone_dsl.dsl.flow import Concurrency, RateLimit
from cyclone_dsl.dsl.schedule import ScheduleSpec, pending_schedules
from cyclone_dsl.dsl.signatures import CallOptions, OnDepFailure, StepCalls
from cyclone_dsl.durations import as_timedelta
from cyclone_dsl.errors import InvalidArgument
from cyclone_dsl.graph.model import NodeOptions
from cyclone_dsl.graph.validate import INT32_MAX, check_options
from cyclone_dsl.payload import MAX_NAME_BYTES, text_problem

P = ParamSpec("P")
R = TypeVar("R")


def make_options(base: NodeOptions, overrides: dict[str, Any]) -> NodeOptions:
    """``base`` with the given options replaced (``None`` keeps the base value)."""
    unknown = set(overrides) - OPTION_NAMES
    if unknown:
        raise InvalidArgument(
            f"unknown option(s) {sorted(unknown)}; the options are {sorted(OPTION_NAMES)}"
        )
    changes = {k: v for k, v in overrides.items() if v is not None}
    for name in ("timeout", "retention"):
        if name in changes:
            changes[name] = as_timedelta(changes[name])
    return attrs.evolve(base, **changes)


#: Keyword arguments a step call in a builder takes: the node options, ``after`` and ``node_id``.
CALL_KEYWORDS = tuple(sorted({*OPTION_NAMES, "after", "node_id", "when", "otherwise", "on_skip"}))
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _cached(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` cached by its arguments (inspect is slow, and asked for every step a worker
    runs); an unhashable callable object among them is looked at each time."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def lookup(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return cached(*args, **kwargs)  # type: ignore[arg-type]
        except TypeError:  # an unhashable argument: not cached
            return fn(*args, **kwargs)

    return lookup


@_cached
def handler_signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """The handler's signature, or None when Python cannot read it (cached)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@_cached
def _is_coroutine_function(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` makes a coroutine: an ``async def``, also reached through a
    ``staticmethod``, a ``functools.partial`` or a callable object's ``async def __call__``."""
    fn = getattr(fn, "__func__", fn)  # a staticmethod object
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - the class's, not a callable test
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(call)


def takes_positional(signature: inspect.Signature) -> bool:
    """Whether a handler takes a positional argument (``ctx`` aside): standalone work passes one."""
    return any(
        p.name != "ctx" and (p.kind in _POSITIONAL or p.kind is p.VAR_POSITIONAL)
        for p in signature.parameters.values()
    )


def describe_positional(signature: inspect.Signature) -> str:
    """``takes 1 positional argument (order)``, ``takes 1 to 2 ...``, ``takes no ...``."""
    params = [p for p in signature.parameters.values() if p.name != "ctx" and p.kind in _POSITIONAL]
    varargs = [p for p in signature.parameters.values() if p.kind is p.VAR_POSITIONAL]
    required = sum(1 for p in params if p.default is p.empty)
    if not params and not varargs:
        return "takes no positional argument"
    if varargs:
        count = f"at least {required}" if required else "any number of"
    elif required == len(params):
        count = str(required)
    else:
        count = f"{required} to {len(params)}"
    noun = "positional argument" if count == "1" else "positional arguments"
    names = [p.name for p in params] + [f"*{p.name}" for p in varargs]
    return f"takes {count} {noun} ({', '.join(names)})"


@_cached
def call_problem(fn: Callable[..., Any], name: str, passed: int, who: str) -> str | None:
    """Why a worker could not call ``fn`` with ``passed`` positional arguments (and ``ctx``).

    None when the call binds (or the signature cannot be read: the worker
    reports that). ``who`` names the caller in the message (``the workflow``).
    Uses :meth:`inspect.Signature.bind` with placeholders; cached per function.
    """
    signature = handler_signature(fn)
    if signature is None:
        return None
    keywords = {"ctx": None} if "ctx" in signature.parameters else {}
    try:
        signature.bind(*([None] * passed), **keywords)
    except TypeError as exc:
        described = describe_positional(signature)
        fits = count_fits(signature, passed)
        if not fits:
            return f"handler {name!r} {described}, but {who} passes {passed}"
        plural = "" if passed == 1 else "s"
        with_ctx = " and ctx=" if keywords else ""
        return (
            f"handler {name!r} cannot be called with {passed} positional argument{plural}"
            f"{with_ctx}: {exc}"
        )
    return None


def count_fits(signature: inspect.Signature, passed: int) -> bool:
    """Whether ``passed`` positional arguments fit the handler's positional parameters."""
    params = [p for p in signature.parameters.values() if p.name != "ctx" and p.kind in _POSITIONAL]
    required = sum(1 for p in params if p.default is p.empty)
    varargs = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    return required <= passed and (varargs or passed <= len(params))


def keyword_problem(name: str, unknown: Sequence[str], fn: Callable[..., Any]) -> str:
    """The message for keyword arguments that are not node options, in a builder."""
    signature = handler_signature(fn)
    order = list(unknown)
    if signature is not None:
        positional = [p for p in signature.parameters if p in unknown]
        if len(positional) == len(unknown):
            order = positional
    quoted = ", ".join(repr(k) for k in unknown)
    verdict = "is not an option" if len(unknown) == 1 else "are not options"
    return (
        f"call of {name!r}: inside a @workflow, a step's inputs are passed positionally, "
        f"as in {name}({', '.join(order)}); keyword arguments are node options "
        f"({', '.join(CALL_KEYWORDS)}); {quoted} {verdict}"
    )


@attrs.define(eq=False, repr=False)
class StepDef(StepCalls[P, R]):
    """A registered handler kind. Call it in a builder to add a node; elsewhere it runs."""

    fn: Callable[P, R]
    name: str
    keep_output: bool
    options: NodeOptions
    max_reclaims: int | None = None
    schedules: list[ScheduleSpec] = attrs.field(factory=list)
    _bound: dict[str, Any] = attrs.field(factory=dict, alias="bound")
    _origin: StepDef[Any, Any] | None = attrs.field(default=None, alias="origin")
    concurrency: Concurrency | None = None
    rate_limit: RateLimit | None = None
    transactional: bool = False
    isolation: str | None = None  # of a transactional handler; None: read committed

    @property
    def is_async(self) -> bool:
        return _is_coroutine_function(self.fn)

    @property
    def takes_ctx(self) -> bool:
        """Whether the handler takes ``ctx`` (not when Python cannot read its signature,
        as for a builtin: it is then called with its input alone)."""
        signature = handler_signature(self.fn)
        return signature is not None and "ctx" in signature.parameters

    def __repr__(self) -> str:
        return f"<{'step' if self.keep_output else 'action'} {self.name}>"

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        builder = active_builder()
        if builder is None:
            return self.fn(*args, **kwargs)
        options = {**self._bound, **kwargs}
        after = options.pop("after", None)
        node_id = options.pop("node_id", None)
        branching = {k: options.pop(k, None) for k in ("when", "otherwise", "on_skip")}
        problems = []
        unknown = [k for k in options if k not in OPTION_NAMES]
        if unknown:
            problems.append(keyword_problem(self.name, unknown, self.fn))
            options = {k: v for k, v in options.items() if k in OPTION_NAMES}
        try:
            node_options = make_options(self.options, options)
        except InvalidArgument as exc:
            problems.append(f"call of {self.name!r}: {exc}")
            node_options = self.options
        if not unknown:  # keywords meant as inputs would make this a second, noisier message
            arity = call_problem(self.fn, self.name, len(args), "the workflow")
            if arity is not None:
                problems.append(arity)
        builder.steps[self.name] = self._origin or self
        ref = builder.add(
            self.name,
            self.name,
            args,
            after=after,
            options=attrs.asdict(node_options, recurse=False),
            keep_output=self.keep_output,
            **branching,
        )
        ref.node.problems.extend(problems)
        if node_id is not None:
            ref.named(node_id)
        return ref

    def with_options(self, **options: Unpack[CallOptions]) -> StepDef[P, R]:
        """The same handler with per-node options (and ``after=`` / ``node_id=``) bound."""
        return attrs.evolve(self, bound={**self._bound, **options}, origin=self._origin or self)

    def named(self, node_id: str) -> StepDef[P, R]:
        """The same handler whose next node gets the id ``node_id``."""
        return self.with_options(node_id=node_id)


def _define(
    fn: Callable[P, R],
    *,
    keep_output: bool,
    name: str | None,
    max_reclaims: int | None,
    options: dict[str, Any],
    flow: _Flow,
) -> StepDef[P, R]:
    if not callable(fn):
        raise InvalidArgument(f"@step decorates a function, not {fn!r}")
    built = make_options(NodeOptions(), options)
    problems = check_options(built)
    if max_reclaims is not None and (
        not isinstance(max_reclaims, int)
        or isinstance(max_reclaims, bool)
        or not 0 <= max_reclaims <= INT32_MAX
    ):
        problems.append(
            f"max_reclaims must be an integer from 0 to {INT32_MAX}, not {max_reclaims!r}"
        )
    kind = name or getattr(fn, "__name__", None)
    if kind is None:
        raise InvalidArgument(
            f"@step: {fn!r} has no __name__ (a functools.partial, a callable object): "
            "give it one with name="
        )
    wrong = text_problem("a handler name", kind, MAX_NAME_BYTES)
    if wrong is None and kind.startswith("@"):
        wrong = f"a handler name must not start with '@': {kind!r}"
    if wrong is not None:
        problems.append(wrong)
    given: dict[str, object] = {
        "concurrency": flow.concurrency,
        "rate_limit": flow.rate_limit,
        "transactional": flow.transactional,
    }
    for option, expected in (
        ("concurrency", Concurrency),
        ("rate_limit", RateLimit),
        ("transactional", bool),
    ):
        if given[option] is not None and not isinstance(given[option], expected):
            problems.append(f"{option} must be a {expected.__name__}, not {given[option]!r}")
    if flow.isolation is not None:
        if flow.isolation not in ISOLATION_LEVELS:
            problems.append(
                f"isolation must be one of {', '.join(ISOLATION_LEVELS)}, not {flow.isolation!r}"
            )
        elif not flow.transactional:
            problems.append("isolation applies to a transactional handler: add transactional=True")
    signature = handler_signature(fn)
    if flow.transactional is True and (signature is None or "ctx" not in signature.parameters):
        problems.append(
            "a transactional handler takes a ctx parameter: it writes on ctx.connection"
        )
    if problems:
        raise InvalidArgument(f"@step {kind!r}: " + "; ".join(problems))
    definition = StepDef(
        fn,
        kind,
        keep_output,
        built,
        max_reclaims,
        schedules=pending_schedules(fn),
        concurrency=flow.concurrency,
        rate_limit=flow.rate_limit,
        transactional=flow.transactional,
        isolation=flow.isolation,
    )
    from cyclone_dsl.dsl.registry import default_registry

    default_registry().register(definition)
    return definition


#: The isolation levels a transactional handler may ask for.
Isolation: TypeAlias = Literal["read committed", "repeatable read", "serializable"]
ISOLATION_LEVELS: tuple[str, ...] = ("read committed", "repeatable read", "serializable")


@attrs.frozen
class _Flow:
    """How the handler runs, beyond its node options: limits and transactionality."""

    concurrency: Concurrency | None
    rate_limit: RateLimit | None
    transactional: bool = False
    isolation: str | None = None


def _decorator(
    keep_output: bool,
    fn: Callable[P, R] | None,
    name: str | None,
    max_reclaims: int | None,
    options: dict[str, Any],
    flow: _Flow,
) -> StepDef[P, R] | Callable[[Callable[P, R]], StepDef[P, R]]:
    def define(inner: Callable[P, R]) -> StepDef[P, R]:
        return _define(
            inner,
            keep_output=keep_output,
            name=name,
            max_reclaims=max_reclaims,
            options=options,
            flow=flow,
        )

    return define(fn) if fn is not None else define


@overload
def step(fn: Callable[P, R], /) -> StepDef[P, R]: ...
@overload
def step(
    *,
    name: str | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    retention: timedelta | float | None = None,
    on_dep_failure: OnDepFailure | None = None,
    max_reclaims: int | None = None,
    concurrency: Concurrency | None = None,
    rate_limit: RateLimit | None = None,
    transactional: bool = False,
    isolation: Isolation | None = None,
) -> Callable[[Callable[P, R]], StepDef[P, R]]: ...
def step(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    retention: timedelta | float | None = None,
    on_dep_failure: OnDepFailure | None = None,
    max_reclaims: int | None = None,
    concurrency: Concurrency | None = None,
    rate_limit: RateLimit | None = None,
    transactional: bool = False,
    isolation: Isolation | None = None,
) -> StepDef[P, R] | Callable[[Callable[P, R]], StepDef[P, R]]:
    """Declare a step: a handler whose output is kept and can feed other nodes.

    ``concurrency`` caps how many steps of this kind run at once per key, and
    ``rate_limit`` how many start per window, across every worker (see
    :class:`Concurrency` and :class:`RateLimit`).

    With ``transactional=True`` the handler gets ``ctx.connection``, a connection
    inside the transaction that records the step's completion: its writes and the
    completion commit together, or not at all (an exception, a timeout, a cancel or
    a lost lease roll them back). ``isolation`` chooses the transaction's level
    (``read committed`` by default). See the transactional steps guide.
    """
    options = {
        "max_attempts": max_attempts,
        "timeout": timeout,
        "queue": queue,
        "priority": priority,
        "retention": retention,
        "on_dep_failure": on_dep_failure,
    }
    return _decorator(
        True,
        fn,
        name,
        max_reclaims,
        options,
        _Flow(concurrency, rate_limit, transactional, isolation),
    )


@overload
def action(fn: Callable[P, R], /) -> StepDef[P, R]: ...
@overload
def action(
    *,
    name: str | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    retention: timedelta | float | None = None,
    on_dep_failure: OnDepFailure | None = None,
    max_reclaims: int | None = None,
    concurrency: Concurrency | None = None,
    rate_limit: RateLimit | None = None,
    transactional: bool = False,
    isolation: Isolation | None = None,
) -> Callable[[Callable[P, R]], StepDef[P, R]]: ...
def action(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    max_attempts: int | None = None,
    timeout: timedelta | float | None = None,
    queue: str | None = None,
    priority: int | None = None,
    retention: timedelta | float | None = None,
    on_dep_failure: OnDepFailure | None = None,
    max_reclaims: int | None = None,
    concurrency: Concurrency | None = None,
    rate_limit: RateLimit | None = None,
    transactional: bool = False,
    isolation: Isolation | None = None,
) -> StepDef[P, R] | Callable[[Callable[P, R]], StepDef[P, R]]:
    """Declare an action: like a step, but its output is not kept (stored as NULL)."""
    options = {
        "max_attempts": max_attempts,
        "timeout": timeout,
        "queue": queue,
        "priority": priority,
        "retention": retention,
        "on_dep_failure": on_dep_failure,
    }
    return _decorator(
        False,
        fn,
        name,
        max_reclaims,
        options,
        _Flow(concurrency, rate_limit, transactional, isolation),
    )
