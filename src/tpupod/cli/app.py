"""The ``tpupod`` command: a typer app with one module per command group.

Errors raised as :class:`~tpupod.errors.TpupodError` become two lines on
stderr (``error: ...`` and ``hint: ...``) and the error's exit code; a
traceback is shown only with ``--debug`` (or ``TPUPOD_DEBUG=1``). So do the
command line's own mistakes that typer finds (:class:`Group`): an unknown
option, a value out of range, a missing argument (exit 2).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from typer._click.core import Context, Parameter  # typer's own click (it vendors one)
from typer._click.exceptions import (
    ClickException,
    MissingParameter,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption
from typer.models import CommandInfo, TyperInfo

from tpupod import __version__
from tpupod.base.reasons import plain_reason
from tpupod.extras import require
from tpupod.fanout.report import print_error, report_failure

P = ParamSpec("P")
R = TypeVar("R")


class Group(TyperGroup):
    """Typer's command group, whose command line mistakes are tpupod's two lines (click
    printed its usage, 'Try ...' and 'Error: ...', with pydantic's wording of a bad value):

        error: --timeout -1: must be at least 0.001
        hint: see 'tpupod exec --help'

    Typer parses the line in ``make_context`` (the group's options) and ``invoke`` (the
    command's, and the command itself), so both report here, for every command."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: Context | None = None, **extra: Any
    ) -> Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except ClickException as exc:
            raise typer.Exit(report_usage_error(exc)) from exc

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except ClickException as exc:
            raise typer.Exit(report_usage_error(exc)) from exc

    def list_commands(self, ctx: Context) -> list[str]:
        """The top level's commands in COMMAND_MODULES's order; a group's as registered."""
        names = super().list_commands(ctx)
        order = list(COMMAND_MODULES)
        return sorted(names, key=lambda name: order.index(name) if name in order else len(order))


class Command(TyperCommand):
    """Typer's command, whose every parsing mistake knows the command (click's parser leaves
    some without: 'requires an argument'), so that the hint names its ``--help``."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            if exc.ctx is None:
                exc.ctx = ctx
            raise

    def format_help(self, ctx: Context, formatter: Any) -> None:
        """Help where each value is named as a person reads it (typer showed its types:
        ``--pod <str>``, ``--retries <int>``, ``-- CMD... <list[str]>``)."""
        for param in self.params:
            if isinstance(param, TyperArgument):
                param.__class__ = _NamedArgument  # its metavar says it; no type after it
            elif isinstance(param, TyperOption) and param.metavar is None and not param.is_flag:
                param.metavar = None if param.count else readable_metavar(param, ctx)
        super().format_help(ctx, formatter)


class _NamedArgument(TyperArgument):
    """An argument shown by its metavar alone (``-- CMD...``), without typer's type label."""

    def display_type_rich(self, ctx: Context) -> str | None:
        return None

    def _rich_display_name(self) -> str:
        """``LOCAL``, as on the usage line (typer listed it as ``local``), or its metavar."""
        return self.metavar or (self.name or "").upper() + ("..." if self.nargs != 1 else "")

    def _usage_display_name(self) -> str:
        """On the usage line as click writes it: ``LOCAL``, ``[RUN]`` when optional, a
        metavar as given (``-- CMD...``); typer 0.29 wrote ``{local}`` and ``[[RUN]]``."""
        name = self._rich_display_name()
        return name if self.required or name.startswith("[") else f"[{name}]"


# float options that are durations in seconds, by a word of their name
SECONDS_WORDS = ("timeout", "interval", "lease", "backoff", "grace", "wait", "every", "notice")


def readable_metavar(option: TyperOption, ctx: Context) -> str:
    """A value's name for help: its choices (``kill|wait``), ``N``, ``PORT``, ``S`` (seconds),
    ``X``, ``PATH``, else the last word of the option's name (``--tpu-type``: ``TYPE``)."""
    label = option.display_type(ctx).strip("<>")
    name = max(option.opts, key=len).lstrip("-")
    word = name.rsplit("-", 1)[-1].upper()
    if "|" in label:
        return label
    if label.startswith("int"):
        return "PORT" if "port" in name else "N"
    if label.startswith("float"):
        return "S" if any(w in name for w in SECONDS_WORDS) else "X"
    if label == "path":
        return "PATH"
    return word


def report_usage_error(exc: ClickException) -> int:
    """Click's error as an ``error:`` line and a hint naming the command's ``--help``; its
    exit code. A bare group (``tpupod jobs``) still prints its help, as click does."""
    if isinstance(exc, NoArgsIsHelpError):
        exc.show()
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "tpupod"
    hint = _pod_as_argument(exc, ctx) or f"see '{path} --help'"
    print_error(f"error: {usage_problem(exc)}", hint, sys.stderr)
    return exc.exit_code


EXTRA_ARGUMENT = re.compile(r"Got unexpected extra argument\(s\) \((\S+)\)")


def _pod_as_argument(exc: ClickException, ctx: Context | None) -> str | None:
    """'tpupod down dev': one extra word to a command that takes --pod and no argument is
    most likely the pod's name."""
    found = EXTRA_ARGUMENT.fullmatch(exc.format_message().removesuffix("."))
    if found is None or ctx is None:
        return None
    params = ctx.command.params
    if any(isinstance(p, TyperArgument) for p in params):
        return None
    if not any("--pod" in getattr(p, "opts", ()) for p in params):
        return None
    return f"did you mean '{ctx.command_path} --pod {found.group(1)}'?"


def usage_problem(exc: ClickException) -> str:
    """What is wrong, in tpupod's words: a bad value as 'FLAG VALUE: what it must be'."""
    if isinstance(exc, typer.BadParameter) and not isinstance(exc, MissingParameter):
        return bad_value(exc)
    if isinstance(exc, NoSuchOption) and exc.possibilities:
        return f"no such option {exc.option_name} (did you mean {' or '.join(exc.possibilities)}?)"
    text = exc.format_message().removesuffix(".")
    return text[:1].lower() + text[1:]


def bad_value(exc: typer.BadParameter) -> str:
    """``--timeout -1: must be at least 0.001``; a check's own message (``--on-fail: 'stop' is
    not one of 'kill', 'wait'``) names the value itself."""
    from pydantic import ValidationError

    name = flag_of(exc.param) if exc.param is not None else "value"
    cause = exc.__cause__
    if not isinstance(cause, ValidationError) or not cause.errors():
        return f"{name}: {exc.message.removesuffix('.')}"
    first = cause.errors()[0]
    if first["type"] == "value_error":
        return f"{name}: {str(first.get('ctx', {}).get('error', first['msg'])).removesuffix('.')}"
    return f"{name} {first['input']}: {plain_reason(first)}"


def flag_of(param: Parameter) -> str:
    """How an option is named in errors: its long flag (``--timeout``, not ``-t``); an
    argument by its metavar."""
    if param.param_type_name != "option":
        return param.metavar or param.name or "value"
    return sorted(param.opts, key=lambda flag: (not flag.startswith("--"), -len(flag)))[0]


app = typer.Typer(
    name="tpupod",
    cls=Group,
    help="Make a multi-host accelerator pod feel like one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"tpupod {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    """Make a multi-host accelerator pod feel like one machine.

    Start with 'tpupod up --name dev --local 2', then 'tpupod exec -- hostname'.
    """


def reporting_errors(
    func: Callable[P, R], *, label: str = "tpupod", needs: tuple[str, ...] = ()
) -> Callable[P, R]:
    """Turn a command's TpupodError into 'error:' and 'hint:' lines and its exit code,
    after checking, before any work, that the extras it ``needs`` are installed."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            require(f"'{label}'", *needs)
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug too: one line, the traceback only with --debug
            raise typer.Exit(report_failure(exc, f"'{label}'")) from exc

    return wrapper


def command(
    name: str,
    *,
    group: typer.Typer | None = None,
    needs: tuple[str, ...] = (),
    **settings: object,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Register a CLI command (of ``group``, else of the app) whose errors are reported the
    tpupod way and which first checks the extras it ``needs`` (``tpupod.extras``)."""
    owner = group or app
    label = " ".join(["tpupod", *([str(group.info.name)] if group else []), name])

    def register(func: Callable[P, R]) -> Callable[P, R]:
        checked = reporting_errors(func, label=label, needs=needs)
        checked.__doc__ = kept_as_written(func.__doc__)
        owner.command(name, cls=Command, **settings)(checked)  # type: ignore[arg-type]
        return func

    return register


def kept_as_written(doc: str | None) -> str | None:
    """A command's docstring with its indented paragraphs (the examples) marked for click
    to print as written: it re-wraps every paragraph at 80 columns, and an example broke in
    the middle of its command line."""
    if doc is None:
        return None
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(
        f"\b\n{p}" if all(line.startswith(" ") for line in p.splitlines()) else p
        for p in paragraphs
    )


# Which module registers each command: a call loads only its command's module (each costs
# 5 to 40 ms to import; a bare `tpupod run` paid for all of them), help loads them all.
# In the order `tpupod --help` lists them: as a user meets them, `down` last.
COMMAND_MODULES = {
    "up": "pods",
    "list": "pods",
    "status": "pods",
    "hosts": "pods",
    "exec": "exec",
    "put": "ops",
    "get": "ops",
    "sync": "ops",
    "setup": "ops",
    "run": "run",
    "logs": "run",
    "stacks": "run",
    "cancel": "run",
    "jobs": "jobs",
    "serve": "serve",
    "fanout": "serve",
    "image": "image",
    "bench": "bench",
    "extract": "extract",
    "dashboard": "dashboard",
    "free-tpu": "ops",
    "agent": "serve",
    "down": "pods",
}


def load_commands(argv: list[str]) -> None:
    """Import the module of the command ``argv`` names, or every command module when it
    names none we know (``--help``, a typo: typer then lists them all)."""
    known = COMMAND_MODULES.get(command_named(argv) or "")
    for module in [known] if known else sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"tpupod.cli.{module}")


def command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names, if it names one we know."""
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    return name if name in COMMAND_MODULES else None


def app_for(name: str | None) -> typer.Typer:
    """The app with only what this call needs typer to build: the command ``name`` alone,
    or for the command list (``--help``, a typo) every command as its name and help,
    without its options. Typer builds every registered command's options before it parses
    anything: about 100 ms of CPU for all of them, 2 to 15 ms for a module's siblings
    (``tpupod --help`` 105 -> 3 ms; it prints the same, tests/test_cli_start.py)."""
    trimmed = copy.copy(app)
    if name is not None:
        trimmed.registered_commands = [c for c in app.registered_commands if c.name == name]
        trimmed.registered_groups = [g for g in app.registered_groups if g.name == name]
    else:
        trimmed.registered_commands = [_listed(c) for c in app.registered_commands]
        trimmed.registered_groups = [_listed_group(g) for g in app.registered_groups]
    return trimmed


def _listed(info: CommandInfo) -> CommandInfo:
    """A command as the command list shows it: its name and help, no options."""

    def listed() -> None:
        raise AssertionError("a listed command is never run")  # pragma: no cover

    listed.__doc__ = info.callback.__doc__ if info.callback else None
    shown = copy.copy(info)
    shown.callback = listed
    return shown


def _listed_group(info: TyperInfo) -> TyperInfo:
    """A command group as the command list shows it: its name and help, no commands."""
    shown, group = copy.copy(info), copy.copy(info.typer_instance)
    if group is not None:
        group.registered_commands, group.registered_groups = [], []
    shown.typer_instance = group
    return shown


def main() -> None:
    """The console script: load the command's module and run."""
    argv = sys.argv[1:]
    load_commands(argv)
    app_for(command_named(argv))(prog_name="tpupod")
