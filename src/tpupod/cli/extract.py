"""``tpupod extract`` (layer activations of a dataset, on one machine or every worker of a
pod) and ``tpupod extract convert-arc`` (ARC tasks to JSONL prompts)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tpupod.cli.app import command
from tpupod.errors import ExtractError
from tpupod.extras import require
from tpupod.fanout.report import print_summary

if TYPE_CHECKING:
    from tpupod.extract.runner import ExtractOptions


def _mesh(text: str) -> tuple[int, int]:
    parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    try:
        mesh = int(parts.pop("data", 1)), int(parts.pop("model", 1))
    except ValueError:
        mesh = (0, 0)
    if parts or min(mesh) < 1 or text.count("=") != text.count(",") + 1:
        raise ExtractError(f"bad --mesh {text!r}", hint="e.g. --mesh data=2,model=1")
    return mesh


@command("extract")
def extract(
    args: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[LAYER... | convert-arc SRC OUT.jsonl]",
            help="More layers after --layers, or the convert-arc command.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Checkpoint folder or gs:// URL.")
    ] = None,
    data: Annotated[
        str | None, typer.Option("--data", help="JSONL file or folder (plain or .gz), or gs://.")
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers", help="Hidden states to save, e.g. '15 16' or 15,16 (0 = embeddings)."
        ),
    ] = None,
    out: Annotated[
        str | None, typer.Option("--out", help="Output folder or gs://BUCKET/PREFIX.")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Samples per step.")] = 8,
    max_length: Annotated[
        int | None,
        typer.Option(
            "--max-length",
            help="Tokens kept per sample (longer ones are cut, counted and listed) "
            "[default: 512, or what the model's positions leave after --generate]",
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")] = "float32",
    mesh: Annotated[
        str, typer.Option("--mesh", help="Each host's devices as data=D,model=M.")
    ] = "data=1,model=1",
    global_mesh: Annotated[
        bool,
        typer.Option(
            "--global-mesh",
            help="With --pod: --mesh spans every host's devices (D x M = the pod's), every host "
            "runs every step in lockstep; for a model one host cannot hold.",
        ),
    ] = False,
    max_samples: Annotated[
        int | None,
        typer.Option("--max-samples", help="Only the first N samples.", show_default=False),
    ] = None,
    generate: Annotated[
        int, typer.Option("--generate", help="Also write each sample's N-token completion.")
    ] = 0,
    temperature: Annotated[
        float, typer.Option("--temperature", help="With --generate: 0 is greedy.")
    ] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="With --generate: the sampling seed.")] = 0,
    shard_samples: Annotated[
        int | None,
        typer.Option(
            "--shard-samples",
            help="Samples per output shard, a multiple of --batch-size "
            "[default: 256, rounded up to one]",
            show_default=False,
        ),
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="A malformed line is fatal.")] = False,
    pod: Annotated[
        str | None,
        typer.Option(
            "--pod",
            "-p",
            help="Run on every worker of this pod (default: on this machine alone).",
            show_default=False,
        ),
    ] = None,
    worker_python: Annotated[
        str | None,
        typer.Option(
            "--worker-python",
            help="With --pod: the python with tpupod on the workers (default: this one on a "
            "local pod, python3 on hosts).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Save chosen layers' activations of every sample, resumably, in safetensors shards;
    or 'tpupod extract convert-arc SRC OUT.jsonl' (ARC tasks to JSONL prompts).

    With --pod, every worker runs its share (by a hash of each id) under
    'tpupod run'; without it, this machine does all. On hosts, workers run
    'python3 -m tpupod extract' with the paths as given (use gs:// or paths the
    hosts have). A rerun resumes: it skips every committed shard. Read the
    output with tpupod.extract.open(OUT).

    Examples:

      tpupod extract --model ./qwen --data prompts.jsonl --layers 15 16 --out acts

      tpupod extract --pod dev --model gs://b/qwen --data gs://b/arc.jsonl --layers 12 --out gs://b/acts

      tpupod extract --pod dev --global-mesh --mesh data=4,model=8 --model gs://b/big ...

      tpupod extract convert-arc arc_format_train.json arc.jsonl
    """
    if args and args[0] == "convert-arc":
        _convert_arc(args[1:])
        return
    require("'tpupod extract'", "model")  # here, and on every worker (they run this command)
    from tpupod.extract.runner import ExtractOptions

    model, data, layers, out = _required(model=model, data=data, layers=layers, out=out)
    options = ExtractOptions(
        model=model,
        data=data,
        layers=_layers(" ".join([layers, *(args or [])])),
        out=out,
        batch_size=batch_size,
        max_length=max_length,
        dtype=dtype,
        mesh=_mesh(mesh),
        max_samples=max_samples,
        generate=generate,
        temperature=temperature,
        seed=seed,
        shard_samples=shard_samples,
        strict=strict,
        global_mesh=global_mesh,
    )
    if pod is not None:
        raise typer.Exit(_on_pod(pod, options, worker_python))
    _here(options)


def _required(**given: str | None) -> tuple[str, ...]:
    """The values of the options that have no default, in the order given."""
    missing = ["--" + name for name, value in given.items() if not value]
    if missing:
        raise ExtractError(f"missing {', '.join(missing)}", hint="see 'tpupod extract --help'")
    return tuple(str(value) for value in given.values())


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.replace(",", " ").split())
    except ValueError:
        raise ExtractError(
            f"bad --layers {text!r}", hint="integers, e.g. --layers '15 16'"
        ) from None


def _on_pod(pod: str, options: ExtractOptions, worker_python: str | None) -> int:
    """Check the input here first (one clear error, nothing started), then launch everywhere."""
    from tpupod.cli.flow.live import run_live
    from tpupod.extract.launcher import plan_launch, run_extract, said_progress
    from tpupod.fanout.context import Sinks
    from tpupod.fanout.progress import PodProgress
    from tpupod.launch.run import RunResult
    from tpupod.pod.state import StateDir

    launch = plan_launch(StateDir().resolve(pod), options, worker_python)

    async def body(live: Sinks) -> RunResult:
        with PodProgress("extract", launch.workers, live.on_line, hide=said_progress) as view:
            return await run_extract(launch, Sinks(view, live.on_notice, live.interrupt))

    result = run_live(launch.workers, False, body)
    print_summary(result.fanout, sys.stderr, title=f"extract {result.launch.launch_id}")
    return result.fanout.exit_code()


def _here(options: ExtractOptions) -> None:
    from tpupod.extract.launcher import run_here

    run_here(options, _say, live=sys.stdout.isatty())


def _say(line: str) -> None:
    print(line, flush=True)


def _convert_arc(paths: list[str]) -> None:
    """ARC tasks (a JSON file of tasks, a task file, or a folder) to JSONL prompts, one per
    test input; the rendering is stable (tpupod.extract.arc), expected outputs go in "answer"."""
    from tpupod.extract.arc import convert

    if len(paths) != 2:
        raise ExtractError(
            "convert-arc takes SRC and OUT.jsonl",
            hint="tpupod extract convert-arc arc_format_train.json arc.jsonl",
        )
    n = convert(Path(paths[0]), Path(paths[1]))
    print(f"{n} samples written to {paths[1]}")
