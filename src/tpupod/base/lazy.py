"""A package's names imported on first use (PEP 562's module ``__getattr__``).

``import tpupod`` stays fast for the CLI and the fast paths, and a process that needs
one part of ``tpupod.model`` (the builtin server's front end, unpickling a tokenizer)
does not load JAX and flax. The packages name the same things under ``TYPE_CHECKING``
for mypy.
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from collections.abc import Callable


def attributes(
    package: str, homes: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A ``__getattr__`` for ``package`` (each name in ``homes`` from the module named
    there) and its ``__dir__`` (the names imported already and those to come: ``dir()``
    and completion show them before their first use)."""

    def getattr_(name: str) -> object:
        home = homes.get(name)
        if home is None:  # a submodule (``from package import part``) is then imported as usual
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes})

    return getattr_, dir_
