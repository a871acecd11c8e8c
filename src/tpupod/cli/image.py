"""``tpupod image build`` and ``image ls``; the container options of ``run`` and ``exec``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tpupod.cli.app import app, command
from tpupod.cli.options import EngineOption, PodOption
from tpupod.fanout.report import format_duration, notice

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


@command("build", group=image_app)
def build(
    context: Annotated[
        Path, typer.Argument(metavar="CONTEXT", help="The build context (a folder).")
    ],
    tag: Annotated[str, typer.Option("--tag", "-t", metavar="TAG", help="The image's tag.")],
    pod: PodOption = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            metavar="DOCKERFILE",
            help="Default: CONTEXT/Dockerfile.",
            show_default=False,
        ),
    ] = None,
    on_each: Annotated[
        bool,
        typer.Option(
            "--on-each",
            help="Build on every worker (one per engine storage) in parallel, "
            "instead of building on worker 0 and sending the image.",
        ),
    ] = False,
    engine: EngineOption = None,
) -> None:
    """Build an image and put it on every worker; its id is checked the same everywhere.

    By default the image is built once, on worker 0, saved, and sent over the
    pod's connections to be loaded on every other worker (once per engine
    storage: workers that share one load it once).

    Examples:

      tpupod image build -t app:1 .

      tpupod image build -t app:1 -f docker/Dockerfile --on-each .
    """
    from tpupod.image.build import BuildRequest, run_build
    from tpupod.image.container_engine import check_engine
    from tpupod.pod.state import StateDir

    target = StateDir().resolve(pod)
    request = BuildRequest(tag, context, file, check_engine(engine), on_each)
    rows = run_build(target, request, notice)
    print(f"{tag}: {rows[0].image_id[:12]} on {len(rows)} workers")
    for row in rows:
        how = f"{row.how} in {format_duration(row.seconds)}" if row.seconds else row.how
        print(f"  {row.worker.label:<4} {row.worker.hostname:<16} {how}")


@command("ls", group=image_app)
def ls(pod: PodOption = None, engine: EngineOption = None) -> None:
    """List the images on every worker: each tag, its id, the workers that have it.

    A tag at different ids on different workers shows as several rows.

    Example:

      tpupod image ls
    """
    from tpupod.image.container_engine import check_engine
    from tpupod.image.listing import images_table
    from tpupod.pod.state import StateDir

    print(images_table(StateDir().resolve(pod), check_engine(engine)))
