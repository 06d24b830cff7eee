"""The static types of a step call: handler shapes, keyword options and ``StepCalls``.

One call site cannot know statically whether it runs inside a ``@workflow``
builder (where a step call adds a node and returns a reference) or outside
one (where it runs the handler). So :class:`StepCalls`, the base of
:class:`~cyclone_dsl.dsl.step.StepDef`, overloads ``__call__``, and the type
checker takes the first reading that fits, in this order:

1. Every argument is a reference (``Ref[T]`` where the handler takes a
   ``T``), or the one argument is a list of references (array binding):
   a builder call, typed ``NodeRef[output]``.
2. The call fits the handler's own signature (``ParamSpec``): a plain call,
   typed as the handler's return type. A builder call whose arguments are
   all plain values (or that has none) reads this way too.
3. Each argument is the declared type or a reference to it, ``ctx`` is left
   out (the worker passes it) and the keyword arguments are node options
   (:class:`CallOptions`): a builder call, typed ``NodeRef[output]``.

The readings of 1 and 3 are selected by a ``self`` type that matches the
handler's shape: 0 to 4 positional parameters or one list, with or without
a keyword ``ctx``, ``def`` or ``async def``. The output of an ``async def``
handler is what it returns once awaited. Whatever fits none of them is a
type error: a wrong argument type, a missing or extra argument, an unknown
keyword, a misspelt ``on_dep_failure``.

Nothing here does any work at run time: the protocols are only matched by
the type checker, and ``StepCalls.__call__`` hands every call to
``StepDef._call``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from datetime import timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeAlias,
    TypeVar,
    overload,
)

from typing_extensions import TypedDict, Unpack

from cyclone_dsl.dsl.builder import NodeRef, Ref
from cyclone_dsl.graph.conditions import Condition

if TYPE_CHECKING:
    from cyclone_dsl.worker.context import StepContext

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
O = TypeVar("O")  # noqa: E741 - the awaited output of an async handler
A_in = TypeVar("A_in", contravariant=True)
B_in = TypeVar("B_in", contravariant=True)
C_in = TypeVar("C_in", contravariant=True)
D_in = TypeVar("D_in", contravariant=True)
R_out = TypeVar("R_out", covariant=True)
F_out = TypeVar("F_out", covariant=True)

OnDepFailure = Literal["fail_run", "cancel_branch"]
OnSkip = Literal["skip", "run"]

#: What ``after=`` takes: one node reference or a sequence of them (control-only edges).
After: TypeAlias = NodeRef[object] | Sequence[NodeRef[object]] | None


class NodeOptionArgs(TypedDict, total=False):
    """The per-node options a builder call may override (``None`` keeps the handler's)."""

    queue: str | None
    priority: int | None
    max_attempts: int | None
    timeout: timedelta | float | None
    retention: timedelta | float | None
    on_dep_failure: OnDepFailure | None


class FanOutOptions(NodeOptionArgs, total=False):
    """The keyword options of ``for_each`` besides its own parameters."""

    node_id: str
    #: Run only when this condition holds (else the node ends skipped).
    when: Condition | None
    #: Run exactly when that node's ``when=`` does not hold (its else branch).
    otherwise: NodeRef[object] | None
    #: With every dependency skipped: skip this node too (the default) or run it.
    on_skip: OnSkip


class CallOptions(FanOutOptions, total=False):
    """The keyword arguments of a step call in a builder: node options, ``after=``, ``node_id=``."""

    after: After


class HasHandler(Protocol[F_out]):
    """A step definition whose handler has the shape ``F_out`` (used as a ``self`` type)."""

    @property
    def fn(self) -> F_out: ...


class Fn0(Protocol[R_out]):
    def __call__(self) -> R_out: ...


class Fn0Ctx(Protocol[R_out]):
    def __call__(self, *, ctx: StepContext) -> R_out: ...


class Fn1(Protocol[A_in, R_out]):
    def __call__(self, a: A_in, /) -> R_out: ...


class Fn1Ctx(Protocol[A_in, R_out]):
    def __call__(self, a: A_in, /, *, ctx: StepContext) -> R_out: ...


class Fn2(Protocol[A_in, B_in, R_out]):
    def __call__(self, a: A_in, b: B_in, /) -> R_out: ...


class Fn2Ctx(Protocol[A_in, B_in, R_out]):
    def __call__(self, a: A_in, b: B_in, /, *, ctx: StepContext) -> R_out: ...


class Fn3(Protocol[A_in, B_in, C_in, R_out]):
    def __call__(self, a: A_in, b: B_in, c: C_in, /) -> R_out: ...


class Fn3Ctx(Protocol[A_in, B_in, C_in, R_out]):
    def __call__(self, a: A_in, b: B_in, c: C_in, /, *, ctx: StepContext) -> R_out: ...


class Fn4(Protocol[A_in, B_in, C_in, D_in, R_out]):
    def __call__(self, a: A_in, b: B_in, c: C_in, d: D_in, /) -> R_out: ...


class Fn4Ctx(Protocol[A_in, B_in, C_in, D_in, R_out]):
    def __call__(self, a: A_in, b: B_in, c: C_in, d: D_in, /, *, ctx: StepContext) -> R_out: ...


class StepCalls(Generic[P, R]):
    """The typed ways to call a step (see the module docstring); ``StepDef`` implements them."""

    __slots__ = ()

    fn: Callable[P, R]

    # 1. Every argument a reference: a builder call.
    @overload
    def __call__(
        self: HasHandler[Fn1[A, Coroutine[Any, Any, O]]],
        a: Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[list[E], Coroutine[Any, Any, O]]],
        a: Sequence[Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2[A, B, Coroutine[Any, Any, O]]],
        a: Ref[A],
        b: Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3[A, B, C, Coroutine[Any, Any, O]]],
        a: Ref[A],
        b: Ref[B],
        c: Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4[A, B, C, D, Coroutine[Any, Any, O]]],
        a: Ref[A],
        b: Ref[B],
        c: Ref[C],
        d: Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[A, R]],
        a: Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[list[E], R]],
        a: Sequence[Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2[A, B, R]],
        a: Ref[A],
        b: Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3[A, B, C, R]],
        a: Ref[A],
        b: Ref[B],
        c: Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4[A, B, C, D, R]],
        a: Ref[A],
        b: Ref[B],
        c: Ref[C],
        d: Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...

    # 2. The handler's own signature: a plain call.
    @overload
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...  # type: ignore[overload-overlap]

    # 3. Values or references, ctx left out, node options: a builder call.
    @overload
    def __call__(
        self: HasHandler[Fn0[Coroutine[Any, Any, O]]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn0Ctx[Coroutine[Any, Any, O]]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[A, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1Ctx[A, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[list[E], Coroutine[Any, Any, O]]],
        a: Sequence[E | Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1Ctx[list[E], Coroutine[Any, Any, O]]],
        a: Sequence[E | Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2[A, B, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2Ctx[A, B, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3[A, B, C, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3Ctx[A, B, C, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4[A, B, C, D, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        d: D | Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4Ctx[A, B, C, D, Coroutine[Any, Any, O]]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        d: D | Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[O]: ...
    @overload
    def __call__(
        self: HasHandler[Fn0[R]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn0Ctx[R]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[A, R]],
        a: A | Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1Ctx[A, R]],
        a: A | Ref[A],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1[list[E], R]],
        a: Sequence[E | Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn1Ctx[list[E], R]],
        a: Sequence[E | Ref[E]],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2[A, B, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn2Ctx[A, B, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3[A, B, C, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn3Ctx[A, B, C, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4[A, B, C, D, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        d: D | Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    @overload
    def __call__(
        self: HasHandler[Fn4Ctx[A, B, C, D, R]],
        a: A | Ref[A],
        b: B | Ref[B],
        c: C | Ref[C],
        d: D | Ref[D],
        /,
        **options: Unpack[CallOptions],
    ) -> NodeRef[R]: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError
