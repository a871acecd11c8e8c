"""tpupod.base.storage: the same calls on a local folder, fsspec's memory:// and gs:// (a local
GCS emulator, through gcsfs, as the extract and bench tests use it)."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tpupod.base import storage
from tpupod.errors import UsageError


@pytest.fixture(params=["local", "memory", "gcs"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    if request.param == "gcs":
        request.getfixturevalue("gcs")
        return f"gs://bkt/{secrets.token_hex(4)}"
    return f"memory://tpupod-test-{secrets.token_hex(4)}"


def test_write_read_list_and_remove(folder: str) -> None:
    assert storage.names(folder) == [] and storage.read(storage.join(folder, "a")) is None
    shard = storage.join(folder, "shard-0.safetensors")
    storage.write(shard, [b"ab", memoryview(b"cd")], sync=False)  # parts, written in turn
    storage.write(storage.join(folder, "run.json"), '{"x": 1}')
    storage.write(storage.join(folder, ".hidden"), b"")
    assert storage.read(shard) == b"abcd" and storage.exists(shard)
    assert storage.read_text(storage.join(folder, "run.json")) == '{"x": 1}'
    assert storage.names(folder) == ["run.json", "shard-0.safetensors"]
    (found,) = storage.glob(folder, "*.json")  # a location of the same kind, to read back
    assert found.endswith("/run.json") and storage.read(found) == b'{"x": 1}'
    storage.remove(shard)
    storage.remove(shard)  # a second time: nothing there, no error
    assert not storage.exists(shard) and storage.read(shard) is None
    with pytest.raises(FileNotFoundError):
        storage.read_text(shard)
    assert (storage.local_path(shard) is None) == storage.is_remote(folder)


def test_local_writers_of_one_file_never_share_a_staging_file(tmp_path: Path) -> None:
    dest = storage.join(str(tmp_path), "results.json")
    texts = [str(i) * 200_000 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda text: storage.write(dest, text), texts * 4))
    assert storage.read_text(dest) in texts
    assert storage.names(str(tmp_path)) == ["results.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # nothing staged is left


def test_remove_staged_takes_a_killed_writers_files_and_nothing_else(tmp_path: Path) -> None:
    for name in (".shard-1.json.tpupod-0a1b2c3d", ".shard-2.json.tpupod-0a1b2c3d", "shard-1.json"):
        (tmp_path / name).write_text("x")
    storage.remove_staged(str(tmp_path), ["shard-1.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".shard-2.json.tpupod-0a1b2c3d",  # another writer's, not named
        "shard-1.json",  # the final file stays
    ]
    storage.remove_staged("memory://nothing-staged", ["shard-1.json"])  # remote: nothing to do


def test_an_unwritable_bucket_is_one_line(gcs: object) -> None:
    storage.check_writable("gs://bkt/ok", "--out")
    assert storage.names("gs://bkt/ok") == []  # the probe is gone
    with pytest.raises(UsageError, match=r"^--out gs://nosuch/x: cannot write there") as info:
        storage.check_writable("gs://nosuch/x", "--out")
    assert info.value.hint and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "words"),
    [("nosuchproto://x", "Protocol not known"), ("gs://", "no bucket"), ("memory:///", "bucket")],
)
def test_a_url_it_cannot_use_is_a_usage_error(url: str, words: str) -> None:
    with pytest.raises(UsageError, match=words) as info:
        storage.names(url)
    assert info.value.hint and "\n" not in str(info.value)
