"""``tpupod extract``: data checks, ARC prompts, shards by hash of id, the output format,
resume after ``kill -9``, a 2-worker pod equal to one process bit for bit, and the
reader, against transformers' hidden states on the tiny fixtures."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file

import tpupod.extract
from tests.checkpoints import CUT_AT, padding_checkpoint
from tests.conftest import CliResult, pod_processes, tpupod_argv, wait_until_gone
from tpupod.errors import DataError, ExtractError
from tpupod.extract import arc, plan, runner
from tpupod.extract import launcher as extract_launcher
from tpupod.extract.data import Sample, read_samples
from tpupod.extract.runner import ExtractOptions, prepare
from tpupod.model import load_model
from tpupod.pod.record import Pod

FIXTURES = Path(__file__).parent / "fixtures"
QWEN2 = FIXTURES / "qwen2-tiny"
LAYERS = ("0", "1", "3")
F32_ATOL = 1e-4  # tests/test_model.py's tolerance against transformers


def _reference(family: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    folder = FIXTURES / f"{family}-tiny"
    return json.loads((folder / "reference.json").read_text()), dict(
        np.load(folder / "reference.npz")
    )


def _write_data(path: Path, extra: int = 61) -> Path:
    """The fixtures' reference prompts (s0..s2) and ``extra`` varied texts (at most 32 tokens:
    two length buckets, so each process compiles two programs)."""
    meta, _ = _reference("qwen2")
    lines = [{"id": f"s{i}", "text": p} for i, p in enumerate(meta["prompts"])]
    words = ["run", "the", "same", "program", "on", "every", "host", "in", "lockstep", "and"]
    for i in range(extra):
        lines.append({"id": f"x{i}", "text": " ".join(words[: 1 + i % len(words)] * (1 + i % 2))})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _args(data: Path, out: Path, *more: str) -> list[str]:
    return [
        "extract", "--model", str(QWEN2), "--data", str(data), "--layers", *LAYERS,
        "--out", str(out), "--batch-size", "4", "--shard-samples", "8", *more,
    ]  # fmt: skip


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _ok(result: CliResult) -> CliResult:
    assert result.code == 0, result.err + result.out
    return result


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One uninterrupted single-process extraction: (its data file, its output folder)."""
    folder = tmp_path_factory.mktemp("extract")
    data = _write_data(folder / "data.jsonl")
    out = folder / "out"
    proc = subprocess.run(tpupod_argv(*_args(data, out)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "64 samples in" in proc.stdout
    return data, out


# ---- the workers' flags -----------------------------------------------------------


def test_the_workers_flags_parse_back_to_the_same_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every field of ExtractOptions, none at its default, goes through worker_argv and the
    real CLI parser and comes back equal: a field the CLI does not take, or takes under
    another name, fails here (the launcher has no list of flags of its own)."""
    import dataclasses

    from typer.testing import CliRunner

    from tpupod.cli.app import app, load_commands
    from tpupod.extract.launcher import worker_argv

    options = ExtractOptions(
        model="m", data="d.jsonl", layers=(0, 15, 16), out="gs://b/o", batch_size=3,
        max_length=100, dtype="bfloat16", mesh=(2, 3), max_samples=7, generate=4,
        temperature=0.7, seed=5, shard_samples=6, strict=True, global_mesh=True,
    )  # fmt: skip
    bare = ExtractOptions(model="", data="", layers=(), out="")
    at_default = [
        f.name
        for f in dataclasses.fields(options)
        if getattr(options, f.name) == getattr(bare, f.name)
    ]
    assert not at_default, f"give these a value that is not the default: {at_default}"
    argv = worker_argv(options, "python3")
    assert argv[:4] == ["python3", "-m", "tpupod", "extract"]
    seen: list[ExtractOptions] = []

    def worker(parsed: ExtractOptions, say: object, mark: object = None) -> None:
        seen.append(parsed)

    monkeypatch.setattr(extract_launcher, "run_worker", worker)
    monkeypatch.delenv("TPUPOD_WORKER_ID", raising=False)
    load_commands(["extract"])
    result = CliRunner().invoke(app, argv[3:])
    assert result.exit_code == 0, result.output
    assert seen == [options]
    # options left at their defaults are left out: each worker takes the same default
    plain = worker_argv(dataclasses.replace(bare, model="m", data="d", out="o"), "py")
    assert not {"--max-length", "--strict", "--global-mesh"} & set(plain)


# ---- data --------------------------------------------------------------------------


def test_reads_text_and_messages_plain_and_gzip_and_names_bad_lines(tmp_path: Path) -> None:
    good = [{"id": "a", "text": "hi"}, {"id": 7, "messages": [{"role": "user", "content": "x"}]}]
    body = "\n".join([json.dumps(good[0]), "{not json", json.dumps(good[1]), '{"id": "b"}'])
    (tmp_path / "one.jsonl").write_text(body + "\n")
    (tmp_path / "two.jsonl.gz").write_bytes(gzip.compress(b'{"id": "c", "text": "z"}\n'))
    skipped: list[str] = []
    read = read_samples(str(tmp_path), on_skip=skipped.append)
    assert [s.id for s in read.samples] == ["a", "7", "c"]
    assert read.samples[1].messages == ({"role": "user", "content": "x"},)
    assert [line.split(": ", 1)[0] for line in skipped] == [
        f"skipped {tmp_path}/one.jsonl:2",
        f"skipped {tmp_path}/one.jsonl:4",
    ]
    assert "exactly one of" in skipped[1]
    with pytest.raises(DataError, match=r"one\.jsonl:2: "):
        read_samples(str(tmp_path), strict=True)
    again = read_samples(str(tmp_path), on_skip=lambda line: None)
    assert again.digest == read.digest
    (tmp_path / "two.jsonl.gz").write_bytes(gzip.compress(b'{"id": "c", "text": "Z"}\n'))
    assert read_samples(str(tmp_path), on_skip=lambda line: None).digest != read.digest


def test_half_a_surrogate_pair_is_a_bad_line_not_an_internal_error(tmp_path: Path) -> None:
    """Web text holds JSON like "\\ud83d" (an emoji cut in half), which loads as a str no
    tokenizer takes: 'tpupod extract' ended in 'internal error: TypeError: TextEncodeInput
    must be ...'. Such a line is now skipped and named, as other bad lines are; a whole
    pair escaped is a character."""
    path = tmp_path / "web.jsonl"
    path.write_text(
        '{"id": 1, "text": "whole \\ud83d\\ude00 pair"}\n'
        '{"id": 2, "text": "half \\ud83d of a pair"}\n'
        '{"id": 3, "messages": [{"role": "user", "content": "x\\udc00"}]}\n'
    )
    skipped: list[str] = []
    read = read_samples(str(path), on_skip=skipped.append)
    assert [(s.id, s.text) for s in read.samples] == [("1", "whole \U0001f600 pair")]
    assert [line.split(": ", 1)[0] for line in skipped] == [
        f"skipped {path}:2",
        f"skipped {path}:3",
    ]
    assert "\\ud83d is half of a UTF-16 surrogate pair" in skipped[0], skipped
    assert "\\udc00 is half of a UTF-16 surrogate pair" in skipped[1], skipped


def test_duplicate_ids_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"id": "a", "text": "1"}\n{"id": "b", "text": "2"}\n{"id": "a", "text": "3"}\n'
    )
    with pytest.raises(DataError, match="duplicate sample ids: 'a'"):
        read_samples(str(path))


BAD_INPUT = {
    "malformed line with --strict": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n[1, 2]\n'),
        ["--strict"],
        "data.jsonl:2: a line must be a JSON object",
    ),
    "duplicate ids": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n{"id": "a", "text": "2"}\n'),
        [],
        "duplicate sample ids: 'a'",
    ),
    "unknown layer": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n'),
        ["--layers", "9"],
        "no layer 9: this model has hidden states 0..3",
    ),
    "not a checkpoint": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n'),
        ["--model", str(FIXTURES)],
        "has no config.json",
    ),
    # the fixture has 256 positions: a long sample failed mid-run, leaving a run.json
    "--max-length beyond the model's positions": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n'),
        ["--max-length", "300"],
        "--max-length 300 exceeds the model's 256 positions",
    ),
    "--max-length and --generate beyond the model's positions": (
        lambda d: d.write_text('{"id": "a", "text": "1"}\n'),
        ["--max-length", "250", "--generate", "10"],
        "--max-length 250 + --generate 10 exceeds the model's 256 positions",
    ),
    "an empty text with --strict": (  # it was saved as one end-of-text token
        lambda d: d.write_text('{"id": "a", "text": "1"}\n{"id": "b", "text": ""}\n'),
        ["--strict"],
        'data.jsonl:2: "text" is empty',
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_error_line_with_a_hint_and_nothing_written(
    case: str, tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    write, more, message = BAD_INPUT[case]
    data = tmp_path / "data.jsonl"
    write(data)
    out = tmp_path / "out"
    args = ["extract", "--model", str(QWEN2), "--data", str(data), "--layers", "1"]
    result = cli_in_process(*args, "--out", str(out), *more)
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert message in lines[0]
    assert not out.exists()


def test_the_help_says_where_extraction_runs_without_pod(cli: Callable[..., CliResult]) -> None:
    """--pod's help said "(default: the only pod)", yet without it this machine extracts."""
    shown = " ".join(_ok(cli("extract", "--help")).out.split())
    assert "the only pod" not in shown, shown
    assert "--pod POD Run on every worker of this pod (default: on this machine alone)" in shown


# ---- ARC ----------------------------------------------------------------------------


def test_arc_tasks_become_stable_prompts(
    tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    task = {
        "train": [{"input": [[0, 1], [1, 0]], "output": [[1, 0], [0, 1]]}],
        "test": [{"input": [[2, 0]], "output": [[0, 2]]}, {"input": [[3]]}],
    }
    src = tmp_path / "arc.json"
    src.write_text(json.dumps({"t2": task, "t1": {**task, "test": task["test"][:1]}}))
    out = tmp_path / "arc.jsonl"
    assert _ok(cli_in_process("extract", "convert-arc", str(src), str(out))).out == (
        f"3 samples written to {out}\n"
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["t1", "t2-0", "t2-1"]
    assert lines[0]["answer"] == "0 2" and "answer" not in lines[2]
    assert lines[0]["text"] == (
        f"{arc.INTRO}\n\nExample 1\nInput:\n0 1\n1 0\nOutput:\n1 0\n0 1\n\n"
        "Test input:\n2 0\nTest output:\n"
    )
    src.write_text(json.dumps({"t": {"train": [], "test": [{"input": [[10]]}]}}))
    bad = cli_in_process("extract", "convert-arc", str(src), str(tmp_path / "x.jsonl"))
    assert bad.code == 2 and "not grids of digits" in bad.err
    assert not (tmp_path / "x.jsonl").exists()


def test_max_samples_keeps_the_first_lines_and_is_part_of_the_run(tmp_path: Path) -> None:
    data = _write_data(tmp_path / "data.jsonl", extra=5)
    options = ExtractOptions(
        model=str(QWEN2), data=str(data), layers=(1,), out=str(tmp_path / "out"), max_samples=2
    )
    prepared = prepare(options, say=lambda line: None)
    assert [s.id for s in prepared.samples] == ["s0", "s1"]
    assert prepared.config.max_samples == 2
    assert not (tmp_path / "out").exists()  # preparing writes nothing


def test_another_runs_output_folder_is_refused(
    reference_run: tuple[Path, Path], tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    data, single = reference_run
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_bytes((single / "run.json").read_bytes())
    args = _args(data, out)
    args[args.index("--layers") + 1 : args.index("--layers") + 4] = ["1"]
    result = cli_in_process(*args)
    assert result.code == 2, result.err
    assert "holds another run's output: layers ([0, 1, 3] -> [1])" in result.err
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_a_pod_run_into_another_runs_output_is_refused_before_any_worker_starts(
    reference_run: tuple[Path, Path], make_pod: Callable[..., Pod],
    cli_in_process: Callable[..., CliResult], tmp_path: Path,
) -> None:  # fmt: skip
    # every worker used to start, load the model and fail alike (gRPC shutdown noise from each)
    data, single = reference_run
    pod = make_pod(workers=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_bytes((single / "run.json").read_bytes())
    args = _args(data, out)
    args[args.index("--layers") + 1 : args.index("--layers") + 4] = ["1"]
    result = cli_in_process(*args, "--pod", pod.name, timeout=60)
    assert result.code == 2, result.err
    assert result.err.splitlines() == [
        f"error: {out} holds another run's output: layers ([0, 1, 3] -> [1])",
        "hint: resume with the same options, or choose another --out",
    ]
    assert result.out == ""  # no worker's line: none started
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_real_inputs_integer_ids_an_empty_text_a_long_one_and_batch_size_3(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    """Integer ids, an empty text (reported, not saved as one end-of-text token), a text
    cut to --max-length (counted and reported), --batch-size 3 with the default
    --shard-samples (256 is no multiple of 3), ids read back in the data's order."""
    words = "run the same program on every host in lockstep and"
    lines: list[dict[str, Any]] = [
        {"id": "zeta", "text": "The quick brown fox"},
        {"id": 5, "text": "def add(a, b):"},
        {"id": "empty", "text": ""},
        {"id": "long", "text": f"{words} " * 4},  # 88 tokens
        {"id": 3, "messages": [{"role": "user", "content": "hi"}]},
        {"id": "alpha", "text": "a"},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["extract", "--model", str(QWEN2), "--data", str(data), "--layers", "1", "3"]
    result = _ok(cli(*args, "--out", str(out), "--batch-size", "3", "--max-length", "40"))
    assert f'skipped {data}:3: "text" is empty' in result.out
    assert "1 of 5 samples cut to --max-length 40 tokens (first: 'long'" in result.out
    ds = tpupod.extract.open(str(out))
    assert ds.ids == ["zeta", "5", "long", "3", "alpha"] and ds.cut == ["long"]
    tok = load_model(QWEN2).tokenizer
    assert tok is not None
    assert ds.tokens(5).tolist() == tok.encode("def add(a, b):")
    assert ds.activations(5, 1).shape == (len(tok.encode("def add(a, b):")), 64)
    assert ds.tokens("long").tolist() == tok.encode(lines[3]["text"])[:40]
    assert ds.activations("long", 3).shape == (40, 64)
    run = json.loads((out / "run.json").read_text())
    assert run["shard_samples"] == 258 and run["max_length"] == 40
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shards"][0]["cut"] == ["long"]
    # the default --max-length is what the model's 256 positions leave after --generate
    options = ExtractOptions(str(QWEN2), str(data), (1,), str(tmp_path / "x"), generate=6)
    assert prepare(options, say=lambda line: None).config.max_length == 250


@pytest.mark.timeout(300)
def test_a_tokenizer_that_pads_and_truncates_gives_each_sample_its_own_tokens(
    tmp_path: Path,
) -> None:
    """A checkpoint whose tokenizer.json turns padding (to the longest of a call) and
    truncation on: every sample was stored at the shard's longest length (pad ids, as
    many rows), generation continued after the pads, tokens/s counted padding."""
    folder = padding_checkpoint(tmp_path / "padded")
    meta, _ = _reference("qwen2")
    words = "run the same program on every host in lockstep and"
    texts = ["a", *meta["prompts"], f"{words} " * 6, "x y", f"{words} " * 2]
    lines: list[dict[str, Any]] = [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)]
    lines.append({"id": "chat", "messages": meta["chat_messages"]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plain = tokenizers.Tokenizer.from_file(str(QWEN2 / "tokenizer.json"))  # "padding": null
    tokenizer = load_model(QWEN2).tokenizer
    assert tokenizer is not None
    chat = tokenizer.apply_chat_template(meta["chat_messages"])
    want = {
        line["id"]: plain.encode(text, add_special_tokens=False).ids
        for line, text in zip(lines, [*texts, chat], strict=True)
    }
    assert {len(ids) for ids in want.values()} >= {1, 8, 19, 132} and max(
        map(len, want.values())
    ) > CUT_AT
    runs = {}
    for batch in (1, 4, 8):
        options = ExtractOptions(
            str(folder), str(data), (0, 3), str(tmp_path / f"b{batch}"), batch_size=batch,
            generate=0 if batch == 4 else 5,  # each generate program compiles for seconds
        )  # fmt: skip
        _, stats = runner.extract_here(options, say=lambda line: None)
        assert stats.tokens == sum(map(len, want.values()))  # tokens/s counts real tokens
        runs[batch] = tpupod.extract.open(options.out)
    assert runs[1].ids == runs[4].ids == runs[8].ids == list(want)
    model = load_model(folder)
    for sample, ids in want.items():
        alone = model.generate([ids], max_new_tokens=5).tokens[0]
        for batch, ds in runs.items():
            assert ds.tokens(sample).tolist() == ids, (batch, sample)
            assert ds.activations(sample, 3).shape == (len(ids), 64)
            if batch != 4:
                assert ds.completion_tokens(sample) == alone, (batch, sample)
            for layer in (0, 3):
                np.testing.assert_allclose(
                    ds.activations(sample, layer), runs[1].activations(sample, layer),
                    atol=F32_ATOL, rtol=0,
                )  # fmt: skip


# ---- plan ---------------------------------------------------------------------------


def test_shards_do_not_depend_on_the_number_of_hosts() -> None:
    samples = [Sample(f"id{i}", text="t") for i in range(50)]
    shards = plan.plan_shards(samples, 8)
    assert [len(s.samples) for s in shards] == [8] * 6 + [2]
    assert plan.plan_shards(list(reversed(samples)), 8) == shards  # file order does not matter
    for hosts in (1, 2, 3, 5):
        owned = [plan.for_host(shards, h, hosts) for h in range(hosts)]
        assert sorted(s.index for part in owned for s in part) == list(range(7))
    assert plan.batches([5, 1, 3, 1], 2) == [[1, 3], [2, 0]]


# ---- output and reader ----------------------------------------------------------------


@pytest.mark.local
def test_single_process_output_matches_transformers(reference_run: tuple[Path, Path]) -> None:
    _, out = reference_run
    meta, arrays = _reference("qwen2")
    ds = tpupod.extract.open(str(out))
    assert len(ds) == 64 and ds.layers == [0, 1, 3]
    assert ds.ids == [f"s{i}" for i in range(3)] + [f"x{i}" for i in range(61)]  # data order
    for i, prompt in enumerate(meta["prompt_ids"]):
        assert ds.tokens(f"s{i}").tolist() == prompt
        for layer in ds.layers:
            got = ds.activations(f"s{i}", layer)
            np.testing.assert_allclose(got, arrays[f"hidden_f32_{i}"][layer], atol=F32_ATOL, rtol=0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 64 and len(manifest["shards"]) == 8
    first = manifest["shards"][0]
    bulk = ds.layer(0, 1)
    assert isinstance(bulk, np.memmap) and bulk.shape == (first["offsets"][-1], 64)
    row = first["ids"].index(first["ids"][-1])
    np.testing.assert_array_equal(
        bulk[first["offsets"][row] : first["offsets"][row + 1]], ds.activations(first["ids"][-1], 1)
    )
    with pytest.raises(ExtractError, match="has no completions"):
        ds.completion("s0")
    official = load_file(out / first["file"])  # the safetensors library reads our shards
    assert sorted(official) == ["hidden.0", "hidden.1", "hidden.3", "offsets", "tokens"]
    np.testing.assert_array_equal(official["hidden.1"], bulk)
    assert official["offsets"].tolist() == first["offsets"]


def test_generate_writes_each_samples_greedy_completion(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    meta, arrays = _reference("qwen2")
    data = tmp_path / "data.jsonl"
    prompts = meta["prompts"][: meta["greedy_prompts"]]
    lines = [{"id": f"s{i}", "text": p} for i, p in enumerate(prompts)]
    lines.append({"id": "chat", "messages": meta["chat_messages"]})  # the chat template applied
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    _ok(cli(*_args(data, out), "--generate", "20", timeout=120))
    ds = tpupod.extract.open(str(out))
    stops = set(load_model(QWEN2).stop_tokens)
    for i in range(len(prompts)):
        got = ds.completion_tokens(f"s{i}")
        assert got == arrays["greedy"][i].tolist()[: len(got)]  # transformers' greedy tokens
        assert len(got) == 20 or got[-1] in stops
        assert ds.completion(f"s{i}") and isinstance(ds.completion(f"s{i}"), str)
    assert ds.tokens("chat").tolist() == meta["chat_ids"]


def test_a_mesh_over_each_hosts_devices_matches_transformers(
    tmp_path: Path, cli: Callable[..., CliResult], cli_in_process: Callable[..., CliResult]
) -> None:
    meta, arrays = _reference("qwen2")
    data = tmp_path / "data.jsonl"
    lines = [{"id": f"s{i}", "text": p} for i, p in enumerate(meta["prompts"])]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    _ok(cli(*_args(data, out), "--mesh", "data=2,model=2", env=env, timeout=120))
    ds = tpupod.extract.open(str(out))
    for i in range(len(lines)):
        for layer in ds.layers:
            got = ds.activations(f"s{i}", layer)
            np.testing.assert_allclose(got, arrays[f"hidden_f32_{i}"][layer], atol=F32_ATOL, rtol=0)
    bad = cli_in_process(*_args(data, tmp_path / "bad"), "--mesh", "data=2,model=2")
    assert bad.code == 1 and "a 2 x 2 mesh needs 4 devices; there are 1" in bad.err
    assert not (tmp_path / "bad").exists()


def test_two_workers_equal_one_process_bit_for_bit(
    reference_run: tuple[Path, Path], make_pod: Callable[..., Pod], cli: Callable[..., CliResult],
    tmp_path: Path,
) -> None:  # fmt: skip
    data, single = reference_run
    pod = make_pod(workers=2)
    out = tmp_path / "out"
    result = _ok(cli(*_args(data, out), "--pod", pod.name, timeout=120))
    assert "[w0] w1 " in result.out  # the per-host table lists both hosts
    assert _files(out) == _files(single)
    # not a terminal: each host's progress as plain lines, its share of samples to the end
    shares = [re.findall(rf"\[w{w}\] progress: (\d+)/(\d+) samples", result.out) for w in (0, 1)]
    assert all(share[0][0] == "0" and share[-1][0] == share[-1][1] for share in shares)
    assert sum(int(share[-1][1]) for share in shares) == 64
    assert "tpupod-progress" not in result.out


def test_an_ssh_pod_equals_one_process_bit_for_bit(
    reference_run: tuple[Path, Path], make_ssh_pod: Callable[..., Pod],
    cli: Callable[..., CliResult],
) -> None:  # fmt: skip
    # Simulated hosts keep /tmp and their home to themselves and share /var/tmp: the data and
    # the output folder every host writes its shards to are there (as on a shared disk).
    data, single = reference_run
    shared = Path(tempfile.mkdtemp(prefix="tpupod-extract-", dir="/var/tmp"))
    try:
        shutil.copy(data, shared / "data.jsonl")
        pod = make_ssh_pod(2)
        args = (*_args(shared / "data.jsonl", shared / "out"), "--pod", pod.name)
        result = _ok(cli(*args, "--worker-python", sys.executable, timeout=180))
        assert _files(shared / "out") == _files(single)
        assert "[w0] w1 " in result.out  # both hosts' rows in the summary
        for worker in ("w0", "w1"):
            assert f"[{worker}] progress: 0/" in result.out
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.timeout(180)
def test_a_global_mesh_over_two_processes_matches_one_process(
    reference_run: tuple[Path, Path], make_pod: Callable[..., Pod], cli: Callable[..., CliResult],
    tmp_path: Path,
) -> None:  # fmt: skip
    # A 2 x 2 mesh over 2 processes of 2 devices: every process runs every step, one program
    # across both (heads and MLP split over "model", the batch over "data"). The launcher is
    # killed with -9 once a shard is committed; the rerun resumes in lockstep.
    data, single = reference_run
    pod = make_pod(workers=2, devices=2)
    out = tmp_path / "out"
    args = (*_args(data, out), "--pod", pod.name, "--global-mesh", "--mesh", "data=2,model=2")
    launcher = subprocess.Popen(
        tpupod_argv(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _kill_when(launcher, lambda: _committed(out) >= 1)
    assert not wait_until_gone(pod.name, timeout=10), "workers outlived their launcher"
    assert 1 <= _committed(out) < 8
    result = _ok(cli(*args, timeout=150))
    for worker in ("w0", "w1"):  # each host ran every step left: the same count on both
        (share,) = set(re.findall(rf"\[{worker}\] progress: \d+/(\d+) samples", result.out))
        assert 0 < int(share) < 64 and int(share) % 8 == 0
    assert len(set(re.findall(r"progress: \d+/(\d+) samples", result.out))) == 1
    want, got = tpupod.extract.open(str(single)), tpupod.extract.open(str(out))
    assert got.ids == want.ids and got.layers == want.layers
    for sample in want.ids:
        np.testing.assert_array_equal(got.tokens(sample), want.tokens(sample))
        for layer in want.layers:
            np.testing.assert_allclose(
                got.activations(sample, layer), want.activations(sample, layer), atol=F32_ATOL,
                rtol=0,
            )  # fmt: skip
    assert {n for n in _files(out) if n.startswith("shard")} == {
        n for n in _files(single) if n.startswith("shard")
    }
    # a mesh that is not the pod's 4 devices: one error, from every host
    bad = cli(*_args(data, tmp_path / "bad"), "--pod", pod.name, "--global-mesh", timeout=120)
    assert bad.code == 2
    why = "error: --global-mesh: a 1 x 1 mesh is 1 devices, the pod has 4 (2 processes)"
    # every worker finds it; the first to say so ends the run, so the other may be stopped
    # before its own line is out
    assert f"[w0] {why}" in bad.err or f"[w1] {why}" in bad.err, bad.err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").glob("shard*"))


@pytest.mark.timeout(240)  # three extraction runs: about 40 s quiet, 90 s under load
def test_resume_after_kill_9_at_several_points_is_identical(
    reference_run: tuple[Path, Path], tmp_path: Path, state_home: Path
) -> None:
    data, single = reference_run
    out = tmp_path / "out"
    for after in (0, 2):  # files staged or committed before the kill
        killed = subprocess.Popen(tpupod_argv(*_args(data, out)), stdout=subprocess.DEVNULL)
        _kill_when(killed, lambda after=after: _staged_or_committed(out) > after)  # type: ignore[misc]
    proc = subprocess.run(tpupod_argv(*_args(data, out)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert _files(out) == _files(single)


def test_kill_9_of_a_worker_and_of_the_launcher_then_resume_on_three_workers(
    reference_run: tuple[Path, Path], make_pod: Callable[..., Pod], cli: Callable[..., CliResult],
    tmp_path: Path,
) -> None:  # fmt: skip
    data, single = reference_run
    two, three = make_pod(workers=2), make_pod(workers=3)
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        tpupod_argv(*_args(data, out), "--pod", two.name), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _kill_when(launcher, lambda: _committed(out) >= 1)
    assert not wait_until_gone(two.name, timeout=10), "workers outlived their launcher"
    launcher = subprocess.Popen(
        tpupod_argv(*_args(data, out), "--pod", two.name), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    before = _committed(out)
    deadline = time.monotonic() + 60
    while _committed(out) <= before and time.monotonic() < deadline:
        time.sleep(0.005)
    workers = [p for p in pod_processes(two.name) if "extract" in " ".join(p.cmdline())]
    victim = next(p for p in workers if p.environ().get("TPUPOD_WORKER_ID") == "1")
    victim.send_signal(signal.SIGKILL)
    assert launcher.wait(60) != 0
    assert not (out / "manifest.json").exists()
    _ok(cli(*_args(data, out), "--pod", three.name, timeout=120))
    assert _files(out) == _files(single)


@pytest.mark.timeout(240)  # two runs through the emulator: 54-74 s at load 13, plus the reference
def test_gs_input_and_output_through_a_gcs_emulator_killed_mid_upload(
    reference_run: tuple[Path, Path], gcs: Any, cli: Callable[..., CliResult]
) -> None:
    data, single = reference_run
    gcs.pipe_file("bkt/in/data.jsonl.gz", gzip.compress(data.read_bytes()))
    args = _args(data, Path("unused"))
    args[args.index(str(data))] = "gs://bkt/in/data.jsonl.gz"
    args[args.index("unused")] = "gs://bkt/acts"

    def uploaded() -> int:
        names = gcs.ls("bkt/acts", detail=False, refresh=True) if gcs.exists("bkt/acts") else []
        return sum(1 for n in names if n.endswith(".safetensors"))

    proc = subprocess.Popen(tpupod_argv(*args), stdout=subprocess.DEVNULL)
    _kill_when(proc, lambda: uploaded() >= 1)  # shards are on their way up
    _ok(cli(*args, timeout=120))
    gcs.invalidate_cache()
    remote = {n.rsplit("/", 1)[-1]: gcs.cat_file(n) for n in gcs.ls("bkt/acts", detail=False)}
    assert remote == _files(single)
    ds = tpupod.extract.open("gs://bkt/acts")
    local = tpupod.extract.open(str(single))
    assert ds.ids == local.ids
    np.testing.assert_array_equal(ds.activations("s1", 3), local.activations("s1", 3))


def _committed(out: Path) -> int:
    return len(list(out.glob("shard-*.json"))) if out.is_dir() else 0


def _staged_or_committed(out: Path) -> int:
    if not out.is_dir():
        return 0
    return _committed(out) + (1 if list(out.glob(".shard-*")) else 0)


def _kill_when(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str], ready: Callable[[], bool]
) -> None:
    """SIGKILL ``proc`` as soon as ``ready()``; fail if it finished first (the kill must land)."""
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before the kill point"


@pytest.mark.timeout(240)
def test_a_log_has_each_progress_count_once_and_a_resume_says_what_was_done(
    make_pod: Callable[..., Pod], cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """Piped (a log), worker 0's progress came twice in two formats ('[w0] 12/203 samples,
    ..., ETA 44 s' and '[w0] progress: 12/203 ..., ETA 44s'); a resumed run did not say how
    many samples were done already."""
    pod = make_pod(workers=2)
    data = _write_data(tmp_path / "data.jsonl", extra=597)
    out = tmp_path / "out"
    often = {"TPUPOD_PROGRESS_S": "0.02"}  # lines between the first and the last, however fast
    run = _ok(cli(*_args(data, out), "--pod", pod.name, timeout=180, env=often))
    own = re.compile(r"\] \d+/\d+ samples, [\d.]+ samples/s, .* writes pending, ETA ")
    logged = _ok(cli("logs", "--pod", pod.name, "-w", "0")).out.splitlines()
    assert any(own.search(line) for line in logged), logged  # worker 0 did say its own line
    assert not [line for line in run.out.splitlines() if own.search(line)], run.out
    counts = re.findall(r"^\[w0\] progress: (\d+)/\d+ samples", run.out, re.MULTILINE)
    assert len(counts) >= 3 and len(counts) == len(set(counts)), run.out  # some between
    assert "resuming" not in run.out
    # resumed after kill -9 of a run on this machine alone: worker 0 says what it found
    shutil.rmtree(out)
    alone = subprocess.Popen(tpupod_argv(*_args(data, out)), stdout=subprocess.DEVNULL)
    _kill_when(alone, lambda: _committed(out) >= 2)
    done = sum(len(json.loads(p.read_text())["ids"]) for p in out.glob("shard-*.json"))
    shards = len(list(out.glob("shard-*.json")))
    again = _ok(cli(*_args(data, out), "--pod", pod.name, timeout=180))
    said = f"[w0] resuming: {done} of 600 samples already extracted ({shards} of 75 shards); "
    assert f"{said}{600 - done} left\n" in again.out, again.out
