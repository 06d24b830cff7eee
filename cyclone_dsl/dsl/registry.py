"""Which workflows and handler kinds a process knows, by name. No I/O."""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable, Iterator
from typing import Any

from cyclone_dsl.dsl.step import StepDef
from cyclone_dsl.dsl.workflow import WorkflowDef
from cyclone_dsl.errors import InvalidArgument, RegistryConflict, UnknownKind, UnknownWorkflow


def object_list(objects: Iterable[object]) -> list[object]:
    """Modules, module names or definitions, read once into a list; a string alone (which
    would be read as one name per character) raises :class:`InvalidArgument`."""
    if isinstance(objects, str | bytes):
        raise InvalidArgument(
            f"give a list of modules, module names or definitions: [{objects!r}], not "
            f"{objects!r} (a string is read as one name per character)"
        )
    if not isinstance(objects, Iterable):
        raise InvalidArgument(
            f"give a list of modules, module names or definitions, not {objects!r}"
        )
    return list(objects)


class Registry:
    """Workflows and kinds by name; two different objects under one name is an error."""

    def __init__(self) -> None:
        self.workflows: dict[str, WorkflowDef] = {}
        self.kinds: dict[str, StepDef[Any, Any]] = {}

    def register(self, obj: object) -> None:
        if isinstance(obj, StepDef):
            self._put(self.kinds, obj.name, obj, "kind")
        elif isinstance(obj, WorkflowDef):
            self._put(self.workflows, obj.name, obj, "workflow")
        else:
            raise TypeError(f"only @step, @action and @workflow objects register, not {obj!r}")

    @staticmethod
    def _put(table: dict[str, Any], name: str, obj: Any, what: str) -> None:
        existing = table.get(name)
        if existing is not None and existing is not obj and existing.fn is not obj.fn:
            raise RegistryConflict(
                f"two different {what}s are named {name!r} ({_where(existing.fn)} and "
                f"{_where(obj.fn)}): rename one with name="
            )
        if existing is None:
            table[name] = obj

    def add_workflow_tree(self, definition: WorkflowDef) -> None:
        """Register a workflow with the kinds its nodes run and its child workflows."""
        if definition.name in self.workflows and self.workflows[definition.name] is definition:
            return
        self.register(definition)
        for step_def in definition.step_defs().values():
            self.register(step_def)
        for child in definition.child_defs().values():
            self.add_workflow_tree(child)

    @classmethod
    def from_objects(cls, objects: Iterable[object]) -> Registry:
        """A registry of modules (or dotted module names) and definitions."""
        registry = cls()
        for obj in object_list(objects):
            for definition in _definitions(obj):
                if isinstance(definition, WorkflowDef):
                    registry.add_workflow_tree(definition)
                else:
                    registry.register(definition)
        return registry

    def workflow(self, name: str) -> WorkflowDef:
        try:
            return self.workflows[name]
        except KeyError:
            raise UnknownWorkflow(
                f"workflow {name!r} is not registered in this process: import the module "
                "that defines it"
            ) from None

    def kind(self, name: str) -> StepDef[Any, Any]:
        try:
            return self.kinds[name]
        except KeyError:
            raise UnknownKind(f"no @step or @action named {name!r} in this process") from None

    def handlers(self) -> Iterator[tuple[str, StepDef[Any, Any]]]:
        return iter(sorted(self.kinds.items()))


def _definitions(obj: object) -> list[object]:
    if isinstance(obj, str):
        try:
            obj = importlib.import_module(obj)
        except ModuleNotFoundError as exc:
            if exc.name is None or not obj.startswith(exc.name):
                raise  # the module exists: one of its own imports failed
            raise InvalidArgument(f"cannot import {obj!r}: {exc}") from exc
        except (ValueError, TypeError) as exc:  # "", ".relative"
            raise InvalidArgument(f"cannot import {obj!r}: {exc}") from exc
    if isinstance(obj, types.ModuleType):
        return [v for v in vars(obj).values() if isinstance(v, StepDef | WorkflowDef)]
    if isinstance(obj, StepDef | WorkflowDef):
        return [obj]
    raise InvalidArgument(f"expected a module, a module name or a definition, not {obj!r}")


_default = Registry()


def default_registry() -> Registry:
    """The process-wide registry the decorators fill."""
    return _default


def _where(fn: object) -> str:
    """Where a handler was defined, for messages (``module.qualname``; a partial or a
    callable object has no qualname of its own)."""
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{qualname}"
