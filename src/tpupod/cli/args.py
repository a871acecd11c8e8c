"""A command's options, declared once: the typer command's signature and the console
script's framework-free reader (its fast path) both come from one declaration.

A command with a fast path (``exec``, ``run``, ``jobs submit``) declares its arguments as
a class of :class:`Args`, one line an option::

    class ExecArgs(Args):
        command: list[str] = rest(metavar="-- CMD...", help="The command.")
        pod: str | None = opt("--pod", "-p", help="The pod to use.")
        grace: float = opt("--grace", default=5.0, minimum=0.0, help="...")

``ExecArgs.read(argv)`` is the fast path's reader: the arguments when they are plain, else
None, and the typer command (``cli/typed.py`` builds its signature from the same class)
reads the line and explains (``--help``, a typo, a value out of range, a flag given a
value). Typer imports pydantic and builds a validator per option: 0.1 to 0.2 s that the
fast paths save on what people type most.

Light: no typing, dataclasses or typer here; the annotations stay text (``from __future__
import annotations``) and are read as the few kinds a command line has.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Self, dataclass_transform
else:

    def dataclass_transform(**_: object) -> object:  # for mypy: Args's fields make __init__
        return lambda cls: cls


class Opt:
    """One option: its spellings, default, help; its name and kind come from the field."""

    __slots__ = ("default", "flags", "help", "kind", "metavar", "minimum", "name", "show_default")

    def __init__(
        self,
        flags: tuple[str, ...],
        default: object,
        help: str,
        metavar: str | None,
        minimum: float | None,
        show_default: bool,
    ) -> None:
        self.flags, self.default, self.help, self.metavar = flags, default, help, metavar
        self.minimum, self.show_default = minimum, show_default
        self.name = self.kind = ""


class Rest:
    """The arguments after the options (the command, after ``--``)."""

    __slots__ = ("help", "metavar", "name", "required")

    def __init__(self, metavar: str, help: str, required: bool) -> None:
        self.metavar, self.help, self.required, self.name = metavar, help, required, ""


def opt(
    *flags: str,
    default: Any = None,
    help: str = "",
    metavar: str | None = None,
    minimum: float | None = None,
    show_default: bool = True,
) -> Any:
    """An option of an :class:`Args` class: ``name: TYPE = opt("--name", "-n", help=...)``.
    A ``bool`` is a flag, a ``list[str]`` is repeatable; ``minimum`` bounds a number."""
    return Opt(flags, default, help, metavar, minimum, show_default)


def rest(*, metavar: str, help: str = "", required: bool = True, default: Any = None) -> Any:
    """The arguments after the options: ``command: list[str] = rest(metavar="-- CMD...")``."""
    return Rest(metavar, help, required)


class Options:
    """The options of one :class:`Args` class, as the reader scans them."""

    def __init__(self, opts: list[Opt], rest: Rest | None) -> None:
        self.opts, self.rest = opts, rest
        self.by_flag = {flag: o for o in opts for flag in o.flags}


@dataclass_transform(kw_only_default=True, field_specifiers=(opt, rest))
class Args:
    """A command's arguments, declared once (see the module's docstring)."""

    __options__: Options

    def __init_subclass__(cls) -> None:
        fields: dict[str, Opt | Rest] = {}
        for klass in reversed(cls.__mro__):  # a subclass may declare a field anew
            notes = vars(klass).get("__annotations__", {})
            for name in notes:
                field = klass.__dict__.get(name)
                if isinstance(field, Opt | Rest):
                    field.name = name
                    if isinstance(field, Opt):
                        field.kind = _kind(str(notes[name]))
                    fields.pop(name, None)  # declared anew: where the subclass puts it
                    fields[name] = field
        opts = [f for f in fields.values() if isinstance(f, Opt)]
        tail = [f for f in fields.values() if isinstance(f, Rest)]
        cls.__options__ = Options(opts, tail[0] if tail else None)

    def __init__(self, **values: Any) -> None:
        options = self.__options__
        known = {o.name for o in options.opts} | ({options.rest.name} if options.rest else set())
        unknown = set(values) - known
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option {sorted(unknown)[0]!r}")
        for o in options.opts:
            default = list(o.default or ()) if o.kind == "list" else o.default  # type: ignore[call-overload]
            setattr(self, o.name, values.get(o.name, default))
        if options.rest is not None:
            setattr(self, options.rest.name, list(values.get(options.rest.name) or []))

    @classmethod
    def names(cls) -> list[str]:
        """Every field's name: the rest first, then the options in order."""
        tail = cls.__options__.rest
        return [*([tail.name] if tail else []), *(o.name for o in cls.__options__.opts)]

    @classmethod
    def default_of(cls, name: str) -> object:
        """An option's default (what it is when not given)."""
        return next(o.default for o in cls.__options__.opts if o.name == name)

    def as_dict(self) -> dict[str, Any]:
        """The arguments by name (lists copied)."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._values().items()}

    def _values(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.names()}

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Args)
            and type(other) is type(self)
            and self._values() == other._values()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._values().items())
        return f"{type(self).__name__}({shown})"

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``."""
        return type(self)(**{**self._values(), **changes})

    @classmethod
    def read(cls, argv: list[str]) -> Self | None:
        """The arguments, when ``argv`` is plain; None: the typer command reads it (and
        explains what is wrong). Options end at ``--`` or the first argument, as the typer
        commands read them (``allow_interspersed_args`` is off)."""
        found = _scan(argv, cls.__options__)
        if found is None:
            return None
        values, tail = found
        options = cls.__options__
        if options.rest is None and tail:
            return None
        if options.rest is not None:
            if options.rest.required and not tail:
                return None
            values[options.rest.name] = tail
        converted = _converted(cls, values)
        return None if converted is None else cls(**converted)


def _kind(note: str) -> str:
    """What a command line gives for an annotation: flag, list, int, float, str, or an enum's
    name (looked up when read)."""
    base = note.replace(" | None", "").strip()
    return {"bool": "flag", "list[str]": "list", "int": "int", "float": "float"}.get(base, base)


def _scan(argv: list[str], options: Options) -> tuple[dict[str, Any], list[str]] | None:
    """``--name value``, ``--name=value``, flags, repeated options; then the rest."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        name, eq, value = argv[i].partition("=") if argv[i].startswith("--") else (argv[i], "", "")
        if name == "--" and not eq:
            return values, argv[i + 1 :]
        o = options.by_flag.get(name)
        if o is None:
            return None  # --help, --debug, a typo: the typer command explains
        if o.kind == "flag":
            if eq:
                return None
            values[o.name] = True
        else:
            if not eq:
                i += 1
                if i == len(argv):
                    return None
                value = argv[i]
            if o.kind == "list":
                values.setdefault(o.name, []).append(value)
            else:
                values[o.name] = value
        i += 1
    return values, argv[i:]


def _converted(cls: type[Args], values: dict[str, Any]) -> dict[str, Any] | None:
    """The scanned text as each option's type, in its range; None for anything not plain."""
    for o in cls.__options__.opts:
        if o.name not in values or o.kind in ("flag", "list", "str"):
            continue
        known: dict[str, Callable[[str], object]] = {"int": _integer, "float": float}
        # an enum (OnFail): the class the annotation names, in the declaring module
        read = known.get(o.kind) or getattr(sys.modules[cls.__module__], o.kind, None)
        if read is None:
            return None
        try:
            values[o.name] = read(values[o.name])
        except ValueError:
            return None
        number = values[o.name]
        if o.minimum is not None and isinstance(number, int | float) and number < o.minimum:
            return None
    return values


def _integer(text: str) -> int:
    """An integer as the CLI reads one (``int()`` alone would take '1_000' and ' 7')."""
    if not text.lstrip("-").isdigit() or not text.isascii():
        raise ValueError(text)
    return int(text)


# -- options several commands share, each spelled and documented once (cli/options.py makes
# typer's Annotated forms of them for the commands without a fast path) --------------------

POD = opt("--pod", "-p", help="The pod to use (default: the only pod).", show_default=False)
WORKER = opt(
    "--worker",
    "-w",
    metavar="SEL",
    help="Workers to use, e.g. 0,2-3, or a pod's slices: s1, s0-1 (default: all).",
    show_default=False,
)
TIMEOUT = opt(
    "--timeout",
    "-t",
    metavar="S",
    minimum=0.001,
    help="Stop every worker still running after S seconds.",
    show_default=False,
)
GRACE = opt(
    "--grace",
    default=5.0,  # fanout.results.DEFAULT_GRACE_S (a test checks they agree)
    metavar="S",
    minimum=0.0,
    help="Seconds between TERM and KILL when stopping.",
)
QUIET = opt("--quiet", "-q", default=False, help="Print only the summary.")
ENV = opt(
    "--env",
    "-e",
    metavar="NAME=VALUE",
    help="Set a variable on every worker (repeatable).",
    show_default=False,
)
IMAGE = opt(
    "--image",
    metavar="TAG",
    help="Run the command in a container of this image on every worker "
    "(host network, the worker's tpupod variables, accelerator devices).",
    show_default=False,
)
MOUNT = opt(
    "--mount",
    metavar="SRC:DST[:ro]",
    help="With --image: mount SRC of the worker at DST in the container (repeatable).",
    show_default=False,
)
ENGINE = opt(
    "--engine",
    metavar="docker|podman",
    help="The container engine (default: docker where its daemon runs, else podman).",
    show_default=False,
)
PRIVILEGED = opt(
    "--privileged",
    default=False,
    help="With --image: a privileged container (else only /dev/accel* and /dev/vfio/*).",
)
