"""``tpupod image build`` and ``image ls``; the container options of ``run`` and ``exec``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from tpupod.cli import app

if TYPE_CHECKING:
    from tpupod.image.containerize import Container

image_app = typer.Typer(
    name="image",
    help="Container images on every worker: build once and load everywhere, list.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(image_app, name="image")

ImageOption = Annotated[
    str | None,
    typer.Option(
        "--image",
        metavar="TAG",
        help="Run the command in a container of this image on every worker "
        "(host network, the worker's tpupod variables, accelerator devices).",
        show_default=False,
    ),
]
MountOption = Annotated[
    list[str] | None,
    typer.Option(
        "--mount",
        metavar="SRC:DST[:ro]",
        help="With --image: mount SRC of the worker at DST in the container (repeatable).",
        show_default=False,
    ),
]
EngineOption = Annotated[
    str | None,
    typer.Option(
        "--engine",
        metavar="docker|podman",
        help="The container engine (default: docker where present, else podman).",
        show_default=False,
    ),
]
PrivilegedOption = Annotated[
    bool,
    typer.Option(
        "--privileged",
        help="With --image: a privileged container (else only /dev/accel* and /dev/vfio/*).",
    ),
]


def container_from_options(
    image: str | None,
    mounts: list[str] | None,
    engine: str | None,
    privileged: bool,
    env_names: list[str],
) -> Container | None:
    """The container ``--image`` and its options ask for (None without --image)."""
    from tpupod.errors import UsageError
    from tpupod.image.containerize import Container, Mount
    from tpupod.image.engine import check_engine

    if image is None:
        if mounts or engine or privileged:
            raise UsageError(
                "--mount, --engine and --privileged go with --image",
                hint="add --image TAG ('tpupod image ls' lists them)",
            )
        return None
    return Container(
        image=image,
        engine=check_engine(engine),
        mounts=tuple(Mount.parse(m) for m in mounts or []),
        env_names=tuple(env_names),
        privileged=privileged,
    )
