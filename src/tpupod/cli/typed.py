"""A typer command whose options are an :class:`~tpupod.cli.args.Args` class: typer reads
the signature built here from the class's fields, and the command gets the class's
instance, so the fast path's reader and typer's parser read one declaration.

    @command("exec", context_settings={"allow_interspersed_args": False})
    @takes(ExecArgs)
    def exec_command(args: ExecArgs) -> None:
        "Run a command on every worker at once."
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from tpupod.cli.args import Args, Opt, Rest

A = TypeVar("A", bound=Args)


def takes(cls: type[A]) -> Callable[[Callable[[A], None]], Callable[..., None]]:
    """A typer command of ``cls``'s options that calls the decorated function with them."""
    hints = typing.get_type_hints(cls)
    options = cls.__options__
    fields: list[Opt | Rest] = [*([options.rest] if options.rest else []), *options.opts]
    parameters = [_parameter(f, hints[f.name]) for f in fields]

    def decorate(func: Callable[[A], None]) -> Callable[..., None]:
        @functools.wraps(func)
        def command(**given: Any) -> None:
            func(cls(**{k: [] if v is None and _listed(hints[k]) else v for k, v in given.items()}))

        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        del command.__wrapped__  # typer reads this signature, not the function's
        return command

    return decorate


def _parameter(field: Opt | Rest, hint: Any) -> inspect.Parameter:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if isinstance(field, Rest):
        default = ... if field.required else None
        info = typer.Argument(
            default, metavar=field.metavar, help=field.help or None, show_default=False
        )
        return inspect.Parameter(field.name, kind, default=info, annotation=hint)
    listed = _listed(hint)
    info = typer.Option(
        None if listed else field.default,
        *field.flags,
        help=field.help or None,
        metavar=field.metavar,
        min=field.minimum,
        show_default=field.show_default,
    )
    annotation = hint | None if listed else hint  # typer gives None for no values
    return inspect.Parameter(field.name, kind, default=info, annotation=annotation)


def annotated(field: Opt, hint: Any) -> Any:
    """A shared option as typer's ``Annotated`` form, for commands without a fast path
    (``pod: PodOption = None``); the default stays the parameter's."""
    info = typer.Option(
        *field.flags,
        help=field.help or None,
        metavar=field.metavar,
        min=field.minimum,
        show_default=field.show_default,
    )
    return typing.Annotated[hint, info]


def _listed(hint: Any) -> bool:
    return typing.get_origin(hint) is list
