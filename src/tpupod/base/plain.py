"""Value objects without ``dataclasses``, for the modules every CLI start imports.

``import dataclasses`` pulls in ``inspect`` (with ``ast``, ``dis`` and ``tokenize``) and
each ``@dataclass`` compiles its methods at import: about 14 ms of CPU here, as much as
Python's own start, on ``tpupod exec``'s fast path. A class that lists its fields in
``__slots__`` and sets them in ``__init__`` gets equality, a hash, a repr and
``replace()`` (as ``dataclasses.replace``) from :class:`Plain`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (mypy reads it as True)
if TYPE_CHECKING:
    from typing import Self


class Plain:
    """Equality, hash, repr and ``replace()`` from the fields named in ``__slots__``."""

    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def replace(self, **changes: object) -> Self:
        """A copy with ``changes`` (field name -> new value)."""
        unknown = set(changes) - set(self.__slots__)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        new = object.__new__(type(self))
        for name in self.__slots__:
            object.__setattr__(new, name, changes.get(name, getattr(self, name)))
        return new
