"""Runs of ``tpupod run`` written as it writes them (``run.json`` and ``wN.log`` per worker),
many at once: the dashboard's history for its tests and benchmarks/dashboard.py."""

from __future__ import annotations

import json
import time

from tpupod.pod.state import StateDir


def write_runs(state: StateDir, pod: str, workers: int, count: int) -> str:
    """``count`` finished runs (every tenth failed, worker 2 first) and one running one (no
    launcher lock: it stays "running"); the running one's launch id."""
    runs = state.pod_dir(pod) / "runs"
    now = time.time() - count * 60
    briefs = [{"id": i, "hostname": "vm"} for i in range(workers)]
    for n in range(count + 1):
        launch = f"20260101-{n:06d}-bench"
        folder = runs / launch
        folder.mkdir(parents=True)
        done = n < count
        failed = done and n % 10 == 0
        record = {
            "launch_id": launch,
            "command": f"python train.py --step {n}",
            "workers": briefs,
            "coordinator": "127.0.0.1:8476",
            "started": now + n * 60,
            "finished": now + n * 60 + 30 if done else None,
            "exit_code": (1 if failed else 0) if done else None,
            "results": [
                {
                    "worker": i,
                    "outcome": "exit 1" if failed and i == 2 else "exit 0",
                    "last_line": f"step {n} done",
                }
                for i in range(workers)
            ]
            if done
            else [],
        }
        (folder / "run.json").write_text(json.dumps(record))
        for i in range(min(workers, 4)):
            (folder / f"w{i}.log").write_text("".join(f"w{i} line {k}\n" for k in range(20)))
    return f"20260101-{count:06d}-bench"
