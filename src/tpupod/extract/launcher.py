"""The launcher's side of ``tpupod extract --pod``: check here, then ``tpupod run`` everywhere.

Every check that needs no compute runs here first (one clear error, nothing
started); then each worker runs ``python -m tpupod extract`` with the same
options under ``tpupod run`` (preflight, rendezvous, supervision, per-worker
logs) and does its share. The workers' flags come from the one options object
(``worker_argv``), field by field, so an option added to ``ExtractOptions``
reaches the workers without a second list of flags here.

    >>> launch = plan_launch(pod, options)
    >>> result = asyncio.run(run_extract(launch))
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path

from tpupod import settings
from tpupod.extract.runner import ExtractOptions, Say, check_output, prepare, run_worker
from tpupod.fanout.context import Context, Sinks
from tpupod.fanout.progress import PodProgress
from tpupod.launch.run import RunResult
from tpupod.launch.run import run as launch_run
from tpupod.pod.record import Pod, Worker
from tpupod.transport import OutputLine, Stream


@dataclass(frozen=True)
class Launch:
    """A checked extraction, ready to start on ``workers`` of ``pod``."""

    pod: Pod
    workers: list[Worker]
    command: str  # what every worker runs


def worker_argv(options: ExtractOptions, python: str) -> list[str]:
    """The same extraction as each worker runs it: ``--FIELD VALUE`` for every field of
    ``options`` (a true flag alone; None or False left out, so each worker takes the same
    default). The CLI's options are named as the fields; a test parses this back."""
    argv = [python, "-m", "tpupod", "extract"]
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        flag = "--" + field.name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, _flag_value(field.name, value)]
    return argv


def _flag_value(name: str, value: object) -> str:
    if isinstance(value, tuple):
        if name == "mesh":
            return "data={},model={}".format(*value)
        return ",".join(map(str, value))
    return str(value)


def absolute(options: ExtractOptions) -> ExtractOptions:
    """Local paths made absolute (a local pod's workers start elsewhere); URLs as given."""

    def fix(p: str) -> str:
        return p if "://" in p else str(Path(p).absolute())

    return dataclasses.replace(
        options, model=fix(options.model), data=fix(options.data), out=fix(options.out)
    )


def plan_launch(pod: Pod, options: ExtractOptions, worker_python: str | None = None) -> Launch:
    """Check the input here (data, model, layers, and the output where this machine sees
    it), before anything starts. ``worker_python``: the python with tpupod on the workers
    (default: this one on a local pod, python3 on hosts)."""
    prepared = prepare(options, say=lambda line: None)
    # a local pod's workers are this machine: this python, and paths from where we stand
    local = pod.on_this_machine
    if local or "://" in options.out:  # else --out is a path on the hosts, not here
        check_output(absolute(options).out, prepared.config)
    argv = worker_argv(absolute(options) if local else options, pod.worker_python(worker_python))
    return Launch(pod, pod.select(None), shlex.join(argv))


async def run_extract(launch: Launch, sinks: Sinks | None = None) -> RunResult:
    """Every worker does its share under ``tpupod run``; a rerun resumes."""
    async with Context(launch.pod, sinks) as ctx:
        return await launch_run(ctx, launch.command, workers=launch.workers)


def said_progress(text: str) -> bool:
    """Worker 0's own progress line, which the launcher's view of every host's markers says
    already (a live table, or a log's ``[wN] progress:`` lines)."""
    return "writes pending, ETA" in text


def run_here(options: ExtractOptions, say: Say, *, live: bool) -> None:
    """All of it in this process: as a worker of 'tpupod run' (progress markers go to the
    launcher), or alone (a live view where ``live``: a terminal; worker 0's plain lines
    otherwise)."""
    on_a_pod = "TPUPOD_WORKER_ID" in settings.environment()  # a worker of 'tpupod run'
    if on_a_pod or not live:
        run_worker(options, say, mark=say if on_a_pod else None)
        return
    here = _Here()
    with PodProgress("extract", [here], None, hide=said_progress) as view:

        def show(text: str) -> None:
            view(here, OutputLine(Stream.STDOUT, text))

        run_worker(options, show, mark=show)


class _Here:
    """This machine as the one host of the live view."""

    id = 0
    hostname = "localhost"
    label = "w0"
