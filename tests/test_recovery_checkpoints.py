"""``tpupod.latest_checkpoint``: the newest complete Orbax step, local or gs:// (issue 23)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tpupod


def test_the_newest_complete_step_of_a_real_checkpoint_manager(tmp_path: Path) -> None:
    import numpy as np
    import orbax.checkpoint as ocp

    assert tpupod.latest_checkpoint(tmp_path / "none") is None  # a first attempt
    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    for step in (0, 5, 10):
        manager.save(step, args=ocp.args.StandardSave({"w": np.full(4, step, np.float32)}))
    manager.wait_until_finished()
    assert tpupod.latest_checkpoint(tmp_path / "ckpt") == 10
    # A write a preemption cut short: Orbax's temporary folder for step 15, never renamed.
    (tmp_path / "ckpt" / "15.orbax-checkpoint-tmp-1764230000").mkdir()
    (tmp_path / "ckpt" / "15.orbax-checkpoint-tmp-1764230000" / "partial").write_text("x")
    (tmp_path / "ckpt" / "notes").mkdir()
    assert tpupod.latest_checkpoint(str(tmp_path / "ckpt")) == 10
    restored = manager.restore(10, args=ocp.args.StandardRestore({"w": np.zeros(4, np.float32)}))
    assert restored["w"].tolist() == [10.0] * 4


def test_on_gs_a_step_counts_once_committed(gcs: Any) -> None:
    gcs.pipe("bkt/run/step_3/commit_success.txt", b"ok")
    gcs.pipe("bkt/run/step_3/state/data", b"x")
    gcs.pipe("bkt/run/step_8/state/data", b"x")  # no commit file: cut short
    gcs.invalidate_cache()
    assert tpupod.latest_checkpoint("gs://bkt/run") == 3
    gcs.pipe("bkt/run/step_8/commit_success.txt", b"ok")
    gcs.invalidate_cache()
    assert tpupod.latest_checkpoint("gs://bkt/run") == 8
    assert tpupod.latest_checkpoint("gs://bkt/nothing") is None
