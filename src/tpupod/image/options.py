"""``--image`` and its options, as ``run`` and ``exec`` take them, made a Container.

Kept light (the container machinery loads only with ``--image``), as the console
script's fast paths and the typer commands both call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpupod.errors import UsageError
from tpupod.image.container_engine import check_engine

if TYPE_CHECKING:
    from tpupod.image.containerize import Container


def container_from_options(
    image: str | None,
    mounts: Sequence[str] | None,
    engine: str | None,
    privileged: bool,
    env_names: Sequence[str],
) -> Container | None:
    """The container ``--image`` and its options ask for (None without --image)."""
    if image is None:
        if mounts or engine or privileged:
            raise UsageError(
                "--mount, --engine and --privileged go with --image",
                hint="add --image TAG ('tpupod image ls' lists them)",
            )
        return None
    # --image only: --help and exec's start import this module, not the containers' code
    from tpupod.image.containerize import Container, Mount

    return Container(
        image=image,
        engine=check_engine(engine),
        mounts=tuple(Mount.parse(m) for m in mounts or []),
        env_names=tuple(env_names),
        privileged=privileged,
    )
