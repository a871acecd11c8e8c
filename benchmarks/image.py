"""``tpupod run --image`` start-to-first-line overhead, beside ``podman run`` by hand.

    .venv/bin/python benchmarks/image.py            # 2 and 4 local workers, 7 runs each

The program prints one line in a busybox container on every worker. Measured
from starting the command to the last worker's line, in the same run, alternating:

* ``tpupod run --image TAG -- echo ready``: preflight, the image checked on every
  worker, rendezvous, one ``podman run`` per worker, supervision, cleanup after;
* by hand: one background ``podman run --rm --network=host TAG echo ready`` per worker;
* ``tpupod run -- echo ready`` without a container, so the difference splits into
  what ``run`` costs anyway and what the container adds.

Podman (Debian's, with runc) runs in a storage of the benchmark's own under /var/tmp,
with the containers.conf the tests use; the base image is a busybox-static rootfs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from common import TPUPOD

from tpupod.pod.lifecycle import up
from tpupod.pod.spec import LocalPodSpec
from tpupod.pod.state import StateDir

STORE = Path("/var/tmp/tpupod-bench-podman")
TAG = "tpupod-bench-base:1"
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""


def configure() -> None:
    """Podman's configuration and storage for this benchmark, and the busybox base image."""
    STORE.mkdir(parents=True, exist_ok=True)
    (STORE / "containers.conf").write_text(CONTAINERS_CONF)
    (STORE / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{STORE}/graph"\nrunroot = "{STORE}/run"\n'
    )
    os.environ["CONTAINERS_CONF"] = str(STORE / "containers.conf")
    os.environ["CONTAINERS_STORAGE_CONF"] = str(STORE / "storage.conf")
    if subprocess.run(["podman", "image", "exists", TAG], check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "rootfs"
        (root / "bin").mkdir(parents=True)
        shutil.copy2("/bin/busybox", root / "bin/busybox")
        for applet in ("sh", "echo", "sleep"):
            (root / "bin" / applet).symlink_to("busybox")
        with tarfile.open(Path(folder) / "rootfs.tar", "w") as tar:
            tar.add(root, arcname=".")
        subprocess.run(["podman", "import", "-q", f"{folder}/rootfs.tar", TAG], check=True)


def first_lines(argv: list[str], count: int) -> float:
    """Start ``argv``; seconds until ``count`` 'ready' lines have arrived."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        seen += line.count("ready")
        if seen == count:
            break
    elapsed = time.perf_counter() - started
    proc.wait()
    proc.stdout.close()
    if seen != count:
        raise RuntimeError(f"{argv[:3]}: only {seen} of {count} workers reported")
    return elapsed


def by_hand(count: int) -> list[str]:
    one = f"podman run --rm --network=host {TAG} echo ready"
    return ["bash", "-c", " ".join([f"{one} &"] * count) + " wait"]


def measure(count: int, runs: int) -> tuple[float, float, float]:
    name = f"image{count}"
    up(LocalPodSpec(name=name, workers=count), StateDir())
    image = [TPUPOD, "run", "--pod", name, "--image", TAG, "--", "echo ready"]
    plain = [TPUPOD, "run", "--pod", name, "--", "echo ready"]
    ours, hand, bare = [], [], []
    for _ in range(runs):  # alternating, so drift on a shared machine hits all three alike
        ours.append(first_lines(image, count))
        hand.append(first_lines(by_hand(count), count))
        bare.append(first_lines(plain, count))
    return statistics.median(ours), statistics.median(hand), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    version = subprocess.run(["podman", "--version"], check=True, capture_output=True, text=True)
    print(f"engine: {version.stdout.strip()}, runc")
    configure()
    print(
        "\n| workers | run --image, median s | podman run by hand, median s | added s "
        "| ratio | run without image, median s |"
    )
    print("|--------:|----------------------:|-----------------------------:|--------:|------:|"
          "---------------------------:|")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tpupod-bench-") as home:
        os.environ["TPUPOD_HOME"] = home
        for count in args.workers:
            ours, hand, bare = measure(count, args.runs)
            print(
                f"| {count:7d} | {ours:21.2f} | {hand:28.2f} | {ours - hand:7.2f} "
                f"| {ours / hand:5.2f} | {bare:27.2f} |"
            )


if __name__ == "__main__":
    main()
