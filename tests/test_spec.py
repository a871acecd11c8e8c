"""A bad pod spec gets one line naming the file, the field and the problem, a hint, and exit 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.errors import SpecError
from tpupod.pod.spec import LocalPodSpec, load_spec_file

BAD_FILES = {
    "not-yaml": ("name: dev\nworkers: [1, 2\n", "bad.yaml:3:1: not valid YAML"),
    "empty": ("", "bad.yaml: the file is empty"),
    "not-a-mapping": ("- dev\n- 2\n", "bad.yaml: expected a mapping of fields, got list"),
    "unknown-field": ("name: dev\nworker: 2\n", "bad.yaml: worker: unknown field"),
    "missing-field": ("name: dev\n", "bad.yaml: workers: required field is missing"),
    "wrong-type": (
        "name: dev\nworkers: two\n",
        "bad.yaml: workers: must be a whole number",
    ),
    "out-of-range": (
        "name: dev\nworkers: 0\n",
        "bad.yaml: workers: must be at least 1",
    ),
    "bad-name": ("name: Dev_1\nworkers: 2\n", "bad.yaml: name: must be 1-63 lowercase letters"),
    "bad-provider": (
        "name: dev\nprovider: azure\nworkers: 2\n",
        "bad.yaml: provider: unknown provider 'azure'",
    ),
    "bad-env-name": (
        "name: dev\nworkers: 1\nenv: {'1X': a}\n",
        "bad.yaml: env: '1X' is not a valid",
    ),
    "reserved-env": (
        "name: dev\nworkers: 1\nenv: {TPUPOD_X: a}\n",
        "bad.yaml: env: 'TPUPOD_X': names starting",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_spec_file_gets_one_line_error_with_hint(
    case: str, tmp_path: Path, cli_in_process: Callable[..., CliResult]
) -> None:
    text, expected = BAD_FILES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = cli_in_process("up", "-f", str(path))
    assert result.code == 2, result.err
    lines = result.err.splitlines()
    assert len(lines) == 2, result.err
    assert lines[0].startswith("error: ") and str(path) in lines[0]
    assert expected.replace("bad.yaml", str(path)) in lines[0]
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in result.err


def test_debug_shows_the_traceback(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: dev\n")
    result = cli("--debug", "up", "-f", str(path))
    assert result.code == 2
    assert "Traceback" in result.err and "required field is missing" in result.err


def test_tpupod_debug_shows_the_traceback(tmp_path: Path, cli: Callable[..., CliResult]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: dev\n")
    result = cli("up", "-f", str(path), env={"TPUPOD_DEBUG": "1"})
    assert result.code == 2 and "Traceback" in result.err
    quiet = cli("up", "-f", str(path), env={"TPUPOD_DEBUG": "0"})
    assert quiet.code == 2 and "Traceback" not in quiet.err


def test_unknown_field_suggests_the_close_name(tmp_path: Path) -> None:
    path = tmp_path / "tpupod.yaml"
    path.write_text("name: dev\nworkers: 2\ndevices_per_workr: 2\n")
    with pytest.raises(SpecError) as info:
        load_spec_file(path)
    assert info.value.hint == "did you mean 'devices_per_worker'?"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec_file(tmp_path / "nope.yaml")


def test_several_problems_are_counted_and_named(tmp_path: Path) -> None:
    """A trial: 'bad3.yaml: wrkers: unknown field (and 1 more problem)' hid which."""
    path = tmp_path / "tpupod.yaml"
    path.write_text("name: X\nworkers: -1\ndevices_per_worker: 0\n")
    with pytest.raises(SpecError, match=r"\(and 2 more problems: workers, devices_per_worker\)"):
        load_spec_file(path)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tpupod.yaml"
    path.write_text("name: dev\nworkers: 2\ndevices_per_worker: 4\nenv: {A: '1'}\n")
    spec = load_spec_file(path, {"name": "dev-2", "workers": None})
    assert spec == LocalPodSpec(name="dev-2", workers=2, devices_per_worker=4, env={"A": "1"})


def test_bad_flags_name_the_flag(cli_in_process: Callable[..., CliResult]) -> None:
    result = cli_in_process("up", "--name", "dev", "--local", "0")
    assert result.code == 2
    assert result.err.startswith("error: --local: must be at least 1 (got 0)")


def test_a_byte_that_is_not_utf8_in_an_env_value_is_named_not_an_internal_error(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    """A trial: `up --env K=$'\\xff'` was 'internal error: PydanticSerializationError'
    (exit 70) when the pod's record was written."""
    result = cli_in_process("up", "--name", "dev", "--local", "1", "--env", "K=a\udcff")
    assert result.code == 2, result.err
    assert result.err.startswith("error: --env: K's value: the byte 0xff is not UTF-8 text"), (
        result.err
    )
    assert "internal error" not in result.err
    assert result.err.splitlines()[1] == (
        "hint: write --env NAME=VALUE as UTF-8 text, e.g. --env XLA_FLAGS=--foo"
    )  # a trial: 'a mapping of NAME: value', the spec file's form
    named = cli_in_process("up", "--name", "dev", "--local", "1", "--env", "\udcff=v")
    assert named.code == 2 and named.err.startswith(  # it echoed '\udcff=v'
        "error: bad --env: the byte 0xff is not UTF-8 text"
    ), named.err
    path = tmp_path / "tpupod.yaml"
    path.write_bytes(b'name: dev\nworkers: 1\nenv: {K: "\\xff"}\n')  # YAML's own escape
    assert load_spec_file(path).env == {"K": "\u00ff"}  # a character: stored as UTF-8


def test_up_without_anything_explains(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    result = cli_in_process("up")
    assert result.code == 2
    assert "nothing to create" in result.err and "hint: " in result.err
