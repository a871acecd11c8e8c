"""A framework-free reader of a command's options, for the console script's fast paths.

``tpupod exec`` and ``tpupod run`` are what people type most, and the CLI framework
(typer imports pydantic and builds a validator per option) costs them 0.1 to 0.2 s
before any work. When the arguments are plain, the console script reads them with
this instead. Anything unusual (``--help``, a typo, a value out of range, a flag
given a value) gives None, and the typer command, the reference for what the options
mean, reads them and explains. Tests check that both readers agree.
"""

from __future__ import annotations

from tpupod.base.plain import Plain


class OptionTable(Plain):
    """A command's options: those that take a value, those repeated, and flags.

    Each maps every spelling (``-w``, ``--worker``) to one field name.
    """

    __slots__ = ("flags", "repeated", "valued")

    def __init__(
        self,
        valued: dict[str, str],
        repeated: dict[str, str] | None = None,
        flags: dict[str, str] | None = None,
    ) -> None:
        self.valued = valued
        self.repeated = repeated or {}
        self.flags = flags or {}

    def extended(
        self,
        valued: dict[str, str],
        repeated: dict[str, str] | None = None,
        flags: dict[str, str] | None = None,
    ) -> OptionTable:
        """This table and more options (``run`` takes ``exec``'s and its own)."""
        return OptionTable(
            {**self.valued, **valued},
            {**self.repeated, **(repeated or {})},
            {**self.flags, **(flags or {})},
        )


class Scanned:
    """The options read from a command line, and what follows them."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.lists: dict[str, list[str]] = {}
        self.flags: set[str] = set()
        self.rest: list[str] = []


def scan(argv: list[str], table: OptionTable) -> Scanned | None:
    """Options up to ``--`` or the first argument (as the CLI: no options after the
    command); None for anything the table does not know."""
    scanned = Scanned()
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        name, eq, value = argv[i].partition("=") if argv[i].startswith("--") else (argv[i], "", "")
        if name == "--" and not eq:
            scanned.rest = argv[i + 1 :]
            return scanned
        if name in table.flags and not eq:
            scanned.flags.add(table.flags[name])
        elif name in table.valued or name in table.repeated:
            if not eq:
                i += 1
                if i == len(argv):
                    return None
                value = argv[i]
            if name in table.repeated:
                scanned.lists.setdefault(table.repeated[name], []).append(value)
            else:
                scanned.values[table.valued[name]] = value
        else:
            return None  # --help, --debug, a typo: the full parser explains
        i += 1
    scanned.rest = argv[i:]
    return scanned
