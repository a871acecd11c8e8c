"""One host's part of an extraction: check everything, load the model, compute its
shards that are not yet committed, and (worker 0) merge the manifests.

Every host holds a whole copy of the model on its own devices (``--mesh``
splits those) and computes its shards alone: there is no collective between
hosts, so no host can hang another by compiling a different program, and a
shard's bytes do not depend on how many hosts run. Hosts meet only through
the rendezvous of ``tpupod run``: at the start, and at the end, where
worker 0 merges the manifests and prints a per-host table.

With ``--global-mesh`` the mesh spans every process's devices instead (a model
too large for one host): every process runs every shard's batches, the same
steps in the same order (the same shards left, checked on every host first),
passing the same batch as JAX's multi-process arrays need, and writes the
shards whose index is its own. The shard plan and files are the same as in the
default mode, so either mode resumes the other's output.

Deferred imports: the launcher and the CLI import this module too (``ExtractOptions``,
``prepare``) and need neither JAX, the model nor the rendezvous client: the worker's half
imports them where it uses them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tpupod.errors import CheckpointError, ExtractError
from tpupod.extract import plan, shards
from tpupod.extract.data import Sample, read_samples
from tpupod.extract.progress import HostStats, Progress
from tpupod.extract.store import Store, Writer, open_store

if TYPE_CHECKING:
    from tpupod.model import ForwardOutput
    from tpupod.model.config import QwenConfig

Say = Callable[[str], None]
FINAL_EXCHANGE_S = 7 * 24 * 3600.0  # hosts finish their shards at their own pace
DEFAULT_MAX_LENGTH = 512  # or the model's positions, if fewer
DEFAULT_SHARD_SAMPLES = 256  # rounded up to a multiple of --batch-size


@dataclasses.dataclass(frozen=True)
class ExtractOptions:
    """What ``tpupod extract`` was asked for."""

    model: str
    data: str
    layers: tuple[int, ...]
    out: str
    batch_size: int = 8
    max_length: int | None = None  # DEFAULT_MAX_LENGTH, at most the model's positions
    dtype: str = "float32"
    mesh: tuple[int, int] = (1, 1)
    max_samples: int | None = None
    generate: int = 0
    temperature: float = 0.0
    seed: int = 0
    shard_samples: int | None = None  # DEFAULT_SHARD_SAMPLES, a multiple of batch_size
    strict: bool = False
    # --mesh spans every process's devices; every process runs every step (lockstep)
    global_mesh: bool = False


@dataclasses.dataclass
class Prepared:
    """Checked inputs: samples, the model's folder and config, the run's identity."""

    samples: list[Sample]
    folder: Path
    config: shards.RunConfig

    @functools.cached_property
    def positions(self) -> dict[str, int]:
        """Each sample's place in the data (the reader gives ids in this order)."""
        return {s.id: i for i, s in enumerate(self.samples)}


def prepare(options: ExtractOptions, say: Say) -> Prepared:
    """Every check that needs no compute, before anything is written."""
    _check_numbers(options)
    read = read_samples(options.data, options.strict, on_skip=say)
    samples = read.samples[: options.max_samples]
    folder, config_hash, model_config = _checkpoint(options.model)
    check_layers(options.layers, model_config.num_hidden_states)
    config = shards.RunConfig(
        model=options.model.rstrip("/").rsplit("/", 1)[-1],
        config_hash=config_hash,
        data_hash=read.digest,
        layers=options.layers,
        dtype=options.dtype,
        max_length=_max_length(options, model_config.max_position_embeddings),
        batch_size=options.batch_size,
        shard_samples=_shard_samples(options),
        max_samples=options.max_samples,
        generate=options.generate,
        temperature=options.temperature,
        seed=options.seed,
    )
    return Prepared(samples, folder, config)


def _check_numbers(options: ExtractOptions) -> None:
    for name, value in (
        ("--batch-size", options.batch_size),
        ("--max-length", options.max_length),
        ("--shard-samples", options.shard_samples),
    ):
        if value is not None and value < 1:
            raise ExtractError(f"{name} must be at least 1", hint=f"give a positive {name}")
    if options.shard_samples is not None and options.shard_samples % options.batch_size:
        raise ExtractError(
            f"--shard-samples {options.shard_samples} is not a multiple of --batch-size "
            f"{options.batch_size}",
            hint="full batches make every step the same program",
        )
    if not options.layers:
        raise ExtractError("no --layers given", hint="e.g. --layers 15 16 (0 = embeddings)")
    if options.dtype not in ("float32", "bfloat16"):
        raise ExtractError(f"unsupported --dtype {options.dtype}", hint="float32 or bfloat16")


def _max_length(options: ExtractOptions, positions: int) -> int:
    """--max-length, checked against the model's positions (with --generate's tokens)
    before anything is written; by default 512, or what the positions leave."""
    room = positions - options.generate
    if room < 1:
        raise ExtractError(
            f"--generate {options.generate} leaves no room: the model has {positions} positions",
            hint=f"give --generate below {positions}",
        )
    if options.max_length is None:
        return min(DEFAULT_MAX_LENGTH, room)
    if options.max_length > room:
        generated = f" + --generate {options.generate}" if options.generate else ""
        raise ExtractError(
            f"--max-length {options.max_length}{generated} exceeds the model's "
            f"{positions} positions",
            hint=f"give --max-length {room} or less",
        )
    return options.max_length


def _shard_samples(options: ExtractOptions) -> int:
    """--shard-samples, or the default rounded up to whole batches."""
    if options.shard_samples is not None:
        return options.shard_samples
    return -(-DEFAULT_SHARD_SAMPLES // options.batch_size) * options.batch_size


def _checkpoint(model: str) -> tuple[Path, str, QwenConfig]:
    """The local checkpoint folder, the hash of its config, the config."""
    from tpupod.model import loading

    try:
        folder = loading.localize(model)
        config = loading.read_config(folder)
    except CheckpointError as exc:
        raise ExtractError(exc.message, exc.hint) from exc
    digest = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    return folder, digest, config


def check_layers(layers: tuple[int, ...], num_hidden_states: int) -> None:
    bad = [i for i in layers if not 0 <= i < num_hidden_states]
    if bad:
        raise ExtractError(
            f"no layer {bad[0]}: this model has hidden states 0..{num_hidden_states - 1} "
            f"(0 = embeddings, {num_hidden_states - 1} = after the final norm)",
            hint=f"choose --layers in 0..{num_hidden_states - 1}",
        )


def open_output(where: str, config: shards.RunConfig) -> Store:
    """The output store, with ``run.json`` written or checked."""
    store = open_store(where)
    existing = store.read(shards.RUN_FILE)
    shards.check_run(existing, config, store.url)
    if existing is None:
        store.write(shards.RUN_FILE, config.to_json())
    return store


def check_output(where: str, config: shards.RunConfig) -> None:
    """What ``open_output`` would refuse, checked without writing anything (a launcher,
    before any worker starts)."""
    if "://" in where:
        store = open_store(where)
        shards.check_run(store.read(shards.RUN_FILE), config, store.url)
        return
    folder = Path(where)
    if folder.exists() and not folder.is_dir():
        raise ExtractError(f"--out {where} is a file", hint="give a folder for the output")
    run_file = folder / shards.RUN_FILE
    existing = run_file.read_bytes() if run_file.is_file() else None
    shards.check_run(existing, config, str(folder))


def todo(prepared: Prepared, store: Store, host: int, hosts: int) -> list[plan.ShardPlan]:
    """This host's shards that are not committed yet."""
    mine = plan.for_host(
        plan.plan_shards(prepared.samples, prepared.config.shard_samples), host, hosts
    )
    present = set(store.names())
    left = []
    for shard in mine:
        _, manifest = shards.files_of(shard.index)
        if manifest not in present or not shards.committed(store.read(manifest), prepared.config):
            left.append(shard)
    return left


def resumed(
    prepared: Prepared, store: Store, left: list[plan.ShardPlan] | None = None
) -> str | None:
    """What a rerun finds committed already, in words; None on a first run. ``left``: every
    shard not committed, where known (else read here, on worker 0 alone)."""
    if left is None:
        if not any(name.endswith(".json") and name.startswith("shard-") for name in store.names()):
            return None  # nothing committed: no manifest to read
        left = todo(prepared, store, 0, 1)
    every = plan.plan_shards(prepared.samples, prepared.config.shard_samples)
    if len(left) == len(every):
        return None
    total = len(prepared.samples)
    waiting = sum(len(s.samples) for s in left)
    return (
        f"resuming: {total - waiting} of {total} samples already extracted "
        f"({len(every) - len(left)} of {len(every)} shards); {waiting} left"
    )


class Extractor:
    """The loaded model and the per-shard compute."""

    def __init__(self, prepared: Prepared, options: ExtractOptions) -> None:
        import jax

        from tpupod.model import load_model, make_mesh

        data, model_axis = options.mesh
        mesh = None
        if options.global_mesh and jax.process_count() > 1:
            if data * model_axis != jax.device_count():
                raise ExtractError(
                    f"--global-mesh: a {data} x {model_axis} mesh is {data * model_axis} "
                    f"devices, the pod has {jax.device_count()} "
                    f"({jax.process_count()} processes)",
                    hint=f"give --mesh data=D,model=M with D x M = {jax.device_count()}",
                )
            mesh = make_mesh(data, model_axis, devices=jax.devices())
        elif data * model_axis > 1:
            mesh = make_mesh(data, model_axis, devices=jax.local_devices()[: data * model_axis])
        self.model = load_model(prepared.folder, dtype=options.dtype, mesh=mesh)
        self.options = options
        self.config = prepared.config
        self.positions = prepared.positions
        assert self.model.tokenizer is not None
        self.tokenizer = self.model.tokenizer

    def tokens(self, samples: tuple[Sample, ...]) -> list[np.ndarray]:
        """Each sample's own token ids (chat template applied to messages), whole; encoded
        as one batch (the tokenizer's threads; it pads and cuts nothing)."""
        texts = [
            self.tokenizer.apply_chat_template(list(s.messages))
            if s.messages is not None
            else s.text or ""
            for s in samples
        ]
        encoded = self.tokenizer.encode_batch(texts)
        for sample, ids in zip(samples, encoded, strict=True):
            if not ids:
                raise ExtractError(
                    f"sample {sample.id!r} has no tokens", hint="drop it from the data"
                )
        return [np.asarray(ids, np.int32) for ids in encoded]

    def _filler(self) -> int:
        return self.tokenizer.pad_id or 0

    def shard(
        self, shard: plan.ShardPlan, on_batch: Callable[[int, int], None]
    ) -> shards.ShardResult:
        """Compute one shard: fixed-size batches, shortest samples first. Batch k+1 is
        dispatched before batch k is copied out, so the device never waits on the host."""
        whole = self.tokens(shard.samples)
        cut_at = self.config.max_length
        toks = [t[:cut_at] for t in whole]
        built = _Built(self.options.layers)
        built.cut = [s.id for s, t in zip(shard.samples, whole, strict=True) if len(t) > cut_at]
        pending: tuple[list[int], ForwardOutput] | None = None
        for batch in [*plan.batches([len(t) for t in toks], self.options.batch_size), None]:
            launched = None if batch is None else (batch, self._launch(toks, batch))
            if pending is not None:
                self._collect(shard.index, toks, *pending, built)
                on_batch(len(pending[0]), sum(len(toks[i]) for i in pending[0]))
            pending = launched
        return built.result(shard, toks, self.positions, self.options.generate > 0)

    def _rows(self, toks: list[np.ndarray], batch: list[int]) -> list[list[int]]:
        rows = [toks[i].tolist() for i in batch]
        return rows + [[self._filler()]] * (self.options.batch_size - len(rows))  # fixed shape

    def _launch(self, toks: list[np.ndarray], batch: list[int]) -> ForwardOutput:
        out = self.model.forward(self._rows(toks, batch), layers=self.options.layers, logits="none")
        for state in out.hidden_states.values():
            state.copy_to_host_async()
        return out

    def _collect(
        self,
        index: int,
        toks: list[np.ndarray],
        batch: list[int],
        out: ForwardOutput,
        built: _Built,
    ) -> None:
        """The batch's real tokens of each layer (views of the host copy, no copy)."""
        _, states = out.numpy()
        for r, i in enumerate(batch):
            for layer in self.options.layers:
                built.hidden[layer].append(states[layer][r, : len(toks[i])])
        built.order += batch
        if self.options.generate:
            gen = self.model.generate(
                self._rows(toks, batch),
                max_new_tokens=self.options.generate,
                temperature=self.options.temperature,
                seed=self.options.seed + index,
            )
            built.completions += [gen.texts[r] if gen.texts else "" for r in range(len(batch))]
            built.completion_tokens += gen.tokens[: len(batch)]


class _Built:
    """A shard's outputs as its batches come back."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.order: list[int] = []
        self.hidden: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
        self.completions: list[str] = []
        self.completion_tokens: list[list[int]] = []
        self.cut: list[str] = []

    def result(
        self,
        shard: plan.ShardPlan,
        toks: list[np.ndarray],
        positions: dict[str, int],
        generated: bool,
    ) -> shards.ShardResult:
        ids = [shard.samples[i].id for i in self.order]
        return shards.ShardResult(
            shard.index,
            ids,
            [toks[i] for i in self.order],
            self.hidden,
            self.completions if generated else None,
            self.completion_tokens if generated else None,
            positions=[positions[i] for i in ids],
            cut=sorted(self.cut, key=positions.__getitem__),
        )


def extract_here(
    options: ExtractOptions,
    say: Say,
    host: int = 0,
    hosts: int = 1,
    agree: Callable[[shards.RunConfig], None] = lambda config: None,
    *,
    mark: Say | None = None,
    agree_left: Callable[[list[int]], None] = lambda left: None,
) -> tuple[Prepared, HostStats]:
    """This host's whole part: prepare, compute its shards, write them. ``agree`` is
    called with the run's config before any compute (workers check they all have it)."""
    prepared = prepare(options, say if host == 0 else lambda line: None)
    agree(prepared.config)
    extractor = Extractor(prepared, options)
    store = open_output(options.out, prepared.config)
    # Global mesh: every process computes every shard (the same steps, one program across
    # the pod) and writes those whose index is its own (k % hosts), which every host must
    # agree are left: a host whose --out differs would otherwise run other steps and hang.
    lockstep = options.global_mesh and hosts > 1
    left = todo(prepared, store, 0, 1) if lockstep else todo(prepared, store, host, hosts)
    if lockstep:
        agree_left([s.index for s in left])
    if host == 0 and (said := resumed(prepared, store, left if lockstep or hosts == 1 else None)):
        say(said)

    def mine(shard: plan.ShardPlan) -> bool:
        return not lockstep or shard.index % hosts == host

    # a killed run's half-written files, of this host's shards only: others write theirs now
    store.remove_staged([n for s in left if mine(s) for n in shards.files_of(s.index)])
    total = sum(len(s.samples) for s in left)
    progress = Progress(host, total, say if host == 0 else None, mark)
    writer = Writer(store, progress.written)
    progress.pending = lambda: writer.pending
    for shard in left:
        result = extractor.shard(shard, progress.step)
        if not mine(shard):
            continue
        tensors, manifest = shards.encode(result, prepared.config)
        safetensors_name, manifest_name = shards.files_of(shard.index)
        writer.put([(safetensors_name, tensors), (manifest_name, manifest)])  # manifest last
        progress.shard_done()
    writer.close()
    return prepared, progress.finish()


def run_worker(options: ExtractOptions, say: Say, mark: Say | None = None) -> None:
    """This process's part: all of it alone, or its share as a worker of ``tpupod run``
    (``init_jax``, every worker checked to have the same run, stats gathered at the end).
    ``mark`` takes this host's progress markers (for a launcher's live view)."""
    from tpupod.launch.identity import worker

    identity = worker()
    if identity.count > 1:
        from tpupod.launch.jaxinit import init_jax

        init_jax()  # a TPU slice's runtime starts on every host together
    prepared, stats = extract_here(
        options,
        say,
        identity.id,
        identity.count,
        _agree(identity.count),
        mark=mark,
        agree_left=_agree_left(identity.count),
    )
    rows = [dataclasses.asdict(stats)]
    if identity.count > 1:
        from tpupod.launch.client import client

        values = client().exchange("extract_done", rows[0], FINAL_EXCHANGE_S)
        rows = [values[k] for k in sorted(values)]
    if identity.id != 0:
        return
    samples, cut = merge_manifests(options, prepared)
    for line in stats_table(rows):
        say(line)
    if cut:
        say(
            f"{len(cut)} of {samples} samples cut to --max-length {prepared.config.max_length} "
            f"tokens (first: {cut[0]!r}; all in manifest.json, ds.cut)"
        )
    say(f"{samples} samples in {options.out} (tpupod.extract.open to read them)")


def _agree_left(hosts: int) -> Callable[[list[int]], None]:
    """With a global mesh, every host must run the same shards (the same steps)."""

    def agree(left: list[int]) -> None:
        if hosts > 1:
            from tpupod.launch.client import assert_same

            assert_same(left, "shards left to extract (--global-mesh: one --out for all)")

    return agree


def _agree(hosts: int) -> Callable[[shards.RunConfig], None]:
    """On a pod, every worker must extract the same run (same data, model, options):
    a host with another copy of the data would silently write other shards."""

    def agree(config: shards.RunConfig) -> None:
        if hosts > 1:
            from tpupod.launch.client import assert_same

            assert_same(json.loads(config.to_json()), "extraction run")

    return agree


def merge_manifests(options: ExtractOptions, prepared: Prepared) -> tuple[int, list[str]]:
    """Write ``manifest.json`` from every shard's manifest; the number of samples in it
    and the ids of those cut to --max-length (in the data's order)."""
    store = open_store(options.out)
    planned = plan.plan_shards(prepared.samples, prepared.config.shard_samples)
    manifests = []
    missing = []
    for shard in planned:
        raw = store.read(shards.files_of(shard.index)[1])
        if raw is None or not shards.committed(raw, prepared.config):
            missing.append(shard.name)
        else:
            manifests.append(raw)
    if missing:
        raise ExtractError(
            f"{len(missing)} shards are not in {store.url} (first: {missing[0]})",
            hint="every host must write to the same place (gs://...), or rerun to resume",
        )
    # every other writer is done: leftovers are a killed run's
    store.remove_staged([shards.RUN_FILE, shards.MANIFEST_FILE])
    store.write(shards.MANIFEST_FILE, shards.merge(prepared.config, manifests))
    cut = [i for raw in manifests for i in json.loads(raw).get("cut", [])]
    return len(prepared.samples), sorted(cut, key=prepared.positions.__getitem__)


def stats_table(rows: list[dict[str, Any]]) -> list[str]:
    """The per-host summary, one line per host."""
    lines = [
        f"{'host':<6}{'samples':>9}{'tokens':>10}{'MB written':>12}{'seconds':>9}{'tok/s':>10}"
    ]
    for r in rows:
        rate = r["tokens"] / r["seconds"] if r["seconds"] > 0 else 0.0
        lines.append(
            f"w{r['host']:<5}{r['samples']:>9}{r['tokens']:>10}{r['bytes'] / 1e6:>12.1f}"
            f"{r['seconds']:>9.1f}{rate:>10.0f}"
        )
    return lines
