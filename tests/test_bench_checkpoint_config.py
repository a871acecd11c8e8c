"""Every problem of a bench config that editing the file fixes names the file, the line and
the column (issue 36, fault 2): YAML syntax errors as PyYAML finds them, and each bad key
where the YAML has it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CliResult
from tpupod.bench.config import load_config
from tpupod.errors import BenchConfigError

# One problem on each of several lines, in block and flow style.
LOCATED = """\
suite_name: located
num_repeats: 0
surprise: 1
checkpoint_config:
  spec:
    w: {dtype: float33, shape: [64, 32], sharding: [data, model]}
    b: {dtype: float32, shape: [63], sharding: [data]}
mesh_config:
  mesh_axes: [data, model]
  dcn_parallelism: {data: 2}
  ici_parallelism: {modle: 2}
benchmarks:
  - generator: pytree
    options:
      use_zarr3: maybe
"""

GOOD = """\
suite_name: good
num_repeats: 2
checkpoint_config:
  spec:
    w: {dtype: float32, shape: [64, 32], sharding: [data, model]}
mesh_config:
  mesh_axes: [data, model]
  dcn_parallelism: {data: 2}
  ici_parallelism: {model: 2}
benchmarks:
  - generator: pytree
    options:
      use_zarr3: [true, false]
"""


def problems_of(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "bench.yaml"
    path.write_text(text)
    with pytest.raises(BenchConfigError) as caught:
        load_config(path)
    return caught.value.message.splitlines()


@pytest.mark.unit
def test_every_problem_names_its_line_and_column(tmp_path: Path) -> None:
    lines = problems_of(tmp_path, LOCATED)
    at = f"  - {tmp_path / 'bench.yaml'}"
    assert lines[0] == f"{tmp_path / 'bench.yaml'}: 6 problems"
    expected = [
        f"{at}:3:1: surprise: unknown key",
        f"{at}:11:21: mesh_config.ici_parallelism.modle: not a mesh axis",
        f"{at}:6:9: checkpoint_config.spec.w.dtype: 'float33'",
        f"{at}:7:49: checkpoint_config.spec.b.sharding[0]: data splits dimension 0 (63)",
        f"{at}:15:7: benchmarks[0].options.use_zarr3: 'maybe'; allowed: true or false",
        f"{at}:2:1: num_repeats: 0",
    ]
    assert len(lines) == 1 + len(expected)
    for line, start in zip(lines[1:], expected, strict=True):
        assert line.startswith(start), (line, start)


@pytest.mark.unit
def test_a_missing_key_names_the_mapping_it_is_missing_from(tmp_path: Path) -> None:
    text = GOOD.replace("  mesh_axes: [data, model]\n", "")
    at = f"  - {tmp_path / 'bench.yaml'}"
    assert f"{at}:6:1: mesh_config.mesh_axes: a list of axis names, please" in problems_of(
        tmp_path, text
    )
    # a top-level key that is missing has no line: the file is named
    text = GOOD.replace("suite_name: good\n", "")
    assert problems_of(tmp_path, text) == [
        f"{tmp_path / 'bench.yaml'}: suite_name: missing; a name for the suite, which "
        "baselines go by"
    ]


@pytest.mark.unit
def test_a_key_given_twice_is_a_problem_at_its_second_place(tmp_path: Path) -> None:
    # PyYAML keeps the last silently; a config whose second num_repeats overrides its first
    # is a mistake to point at, not to guess about
    text = GOOD + "num_repeats: 3\n"
    assert problems_of(tmp_path, text) == [
        f"{tmp_path / 'bench.yaml'}:14:1: num_repeats: given twice (first on line 2)"
    ]


@pytest.mark.unit
def test_a_merge_key_override_is_no_duplicate(tmp_path: Path) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(
        GOOD.replace(
            "      use_zarr3: [true, false]\n",
            "      use_zarr3: [true, false]\n"
            "  - generator: pytree\n"
            "    options: &more {use_ocdbt: true, use_zarr3: true}\n"
            "  - generator: pytree\n"
            "    options:\n"
            "      <<: *more\n"
            "      use_zarr3: false\n",
        )
    )
    config = load_config(path)
    assert [c.options["use_zarr3"] for c in config.combinations][2:] == [True, False]


SYNTAX = [
    (
        "suite_name: s\nnum_repeats: 2\nbenchmarks\n  - generator: pytree\n",
        "4:14: not valid YAML: could not find expected ':' "
        "(while scanning a simple key at line 3, column 1)",
    ),
    (
        "suite_name: s\ncheckpoint_config:\n  spec:\n    w: {dtype: float32}\n   bad: 1\n",
        "5:4: not valid YAML: expected <block end>, but found '<block mapping start>' "
        "(while parsing a block mapping at line 3, column 3)",
    ),
    (
        "suite_name: s\nbenchmarks:\n\t- generator: pytree\n",
        "3:1: not valid YAML: found character '\\t' that cannot start any token",
    ),
    (
        "suite_name: s\n---\nsuite_name: t\n",
        "2:1: not valid YAML: but found another document "
        "(expected a single document in the stream at line 1, column 1)",
    ),
]


@pytest.mark.parametrize(("text", "said"), SYNTAX, ids=["colon", "indent", "tab", "two-documents"])
def test_a_yaml_syntax_error_names_the_line_and_column(
    cli_in_process: Callable[..., CliResult], tmp_path: Path, text: str, said: str
) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(text)
    run = cli_in_process("bench", "checkpoint", "-c", str(path), "-o", str(tmp_path / "out"))
    assert run.code == 2, run.out + run.err
    assert run.err.strip().splitlines() == [
        f"error: {path}:{said}",
        "hint: fix the YAML there; the format is Orbax's benchmark YAML, see "
        "'tpupod bench checkpoint --help'",
    ]


def test_a_single_bad_key_is_one_line_naming_its_place(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(GOOD.replace("use_zarr3: [true, false]", "use_zarr3: [true, maybe]"))
    run = cli_in_process("bench", "checkpoint", "-c", str(path), "-o", str(tmp_path / "out"))
    assert run.code == 2, run.out + run.err
    assert run.err.strip().splitlines() == [
        f"error: {path}:13:7: benchmarks[0].options.use_zarr3: 'maybe'; allowed: true or "
        "false, or a list of them",
        "hint: the format is Orbax's benchmark YAML; see 'tpupod bench checkpoint --help'",
    ]


def test_a_file_that_is_not_text_is_one_error(
    cli_in_process: Callable[..., CliResult], tmp_path: Path
) -> None:
    path = tmp_path / "bench.yaml"
    path.write_bytes(b"suite_name: \xff\xfe\n")
    run = cli_in_process("bench", "checkpoint", "-c", str(path), "-o", str(tmp_path / "out"))
    assert run.code == 2, run.out + run.err
    assert run.err.strip().splitlines() == [
        f"error: {path}:1:13: not UTF-8 text (byte 0xff)",
        "hint: save the config as UTF-8",
    ]


def test_an_unknown_option_and_a_bad_value_in_one_block_are_both_said(
    cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """A block with an unknown option and a bad value said only the unknown option, though
    the README promises a line per bad key: the user fixed one and met the other next run."""
    path = tmp_path / "bench.yaml"
    path.write_text(
        GOOD.replace("use_zarr3: [true, false]", "use_zarr3: maybe\n      use_zarr4: true")
    )
    run = cli("bench", "checkpoint", "-c", str(path), "-o", str(tmp_path / "out"))
    assert run.code == 2, run.out + run.err
    lines = run.err.strip().splitlines()
    assert lines[0] == f"error: {path}: 2 problems", run.err
    assert lines[1].startswith(f"  - {path}:14:7: benchmarks[0].options.use_zarr4: unknown option")
    assert lines[2].startswith(f"  - {path}:13:7: benchmarks[0].options.use_zarr3: 'maybe'")
    assert lines[3].startswith("hint: ") and len(lines) == 4, run.err
