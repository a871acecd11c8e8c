"""A full disk under the state directory (a real tmpfs of a few MB): plain errors where
nothing can start, and a run already going on that goes on.

A full home is common on a shared development box; it was an 'internal error:
OSError', and a disk that filled during 'tpupod run' killed the launcher (and with
it the workers) over its own log files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import CliResult, require, tpupod_argv
from tpupod.pod.record import Pod

pytestmark = pytest.mark.local  # mounts a tmpfs: root


SIZE_MB = 4
DD = ["dd", "if=/dev/zero", "bs=1M", f"count={SIZE_MB}"]  # bounded: never past the tmpfs


@pytest.fixture
def small_home(state_home: Path) -> Iterator[Path]:
    """The state directory on a 4 MB tmpfs of its own."""
    require(os.geteuid() == 0, "mounting a tmpfs needs root")
    state_home.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(state_home)], check=True
    )
    try:
        yield state_home
    finally:
        subprocess.run(["umount", "-l", str(state_home)], check=False)


def fill(home: Path) -> Path:
    """Every free byte of ``home``'s disk taken by one file."""
    filler = home / "filler"
    subprocess.run([*DD, f"of={filler}"], capture_output=True)
    return filler


def test_nothing_starts_on_a_full_disk_and_it_is_said_plainly(
    small_home: Path, cli: Callable[..., CliResult], make_pod: Callable[..., Pod]
) -> None:
    pod = make_pod(2)
    fill(small_home)
    made = cli("up", "--name", "more", "--local", "1")
    assert made.code == 1, made.err
    assert "error: No space left on device: " in made.err and "internal error" not in made.err
    assert "df -h" in made.err
    ran = cli("run", "--pod", pod.name, "--", "echo hi")
    assert ran.code == 1 and "cannot keep the run's logs in " in ran.err, ran.err
    assert "internal error" not in ran.err and "[w0] hi" not in ran.out
    assert not list((small_home / "pods" / pod.name / "runs").iterdir())  # no half run left


def test_a_run_whose_disk_fills_goes_on_and_its_record_says_the_logs_stop(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """Worker 0 fills the disk mid-run and prints 2,000 lines; once the launcher has said
    it cannot keep them, the test frees the disk and the worker ends."""
    pod = make_pod(2)
    filler = small_home / "filler"  # a run starts in the launcher's folder: name the disk
    program = (
        f'if [ "$TPUPOD_WORKER_ID" = 0 ]; then echo before; {" ".join(DD)} of={filler} '
        "2>/dev/null; for i in $(seq 2000); do echo line $i of a log that no longer fits; "
        f"done; for i in $(seq 300); do [ -e {filler} ] && sleep 0.1; done; fi; echo end"
    )
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # the launcher's notices, as they come
        said.append(line)
        if "cannot write the run's logs in " in line:
            filler.unlink()
            break
    out, err = proc.communicate(timeout=60)
    err = "".join(said) + err
    assert proc.returncode == 0, err
    assert "not kept" in err and "internal error" not in err and "Traceback" not in err
    shown = out.splitlines()
    assert "[w0] line 2000 of a log that no longer fits" in shown and "[w0] end" in shown
    assert "[w1] end" in shown
    logs = subprocess.run(
        tpupod_argv("logs", "--pod", pod.name), capture_output=True, text=True, timeout=30
    )
    assert "(its logs stop early: No space left on device)" in logs.stderr, logs.stderr
    assert "ended with exit code 0" in logs.stderr
    assert "[w0] before" in logs.stdout and "[w0] line 2000" not in logs.stdout


def test_a_job_submitted_to_a_full_disk_names_the_file_and_the_store_stays_whole(
    small_home: Path, cli: Callable[..., CliResult]
) -> None:
    """The SQLite store's error said 'check that the database is up and reachable', a
    server's hint, for a file on a full disk."""
    assert cli("jobs", "submit", "--", "echo first").code == 0
    filler = fill(small_home)
    refused = cli("jobs", "submit", "--", "echo " + "x" * 5000)
    assert refused.code == 1 and "internal error" not in refused.err, refused.err
    assert f"it is the file {small_home / 'jobs.db'}: check the disk it is on" in refused.err
    filler.unlink()
    listed = cli("jobs", "ls")
    assert listed.code == 0 and len(listed.out.splitlines()) == 2, listed.out  # header, first


def test_a_run_with_retries_waits_for_space_to_go_on(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """The chaos harness (issue 41): a worker killed while the state directory's disk was
    full ended `run --retries` at once ('error: No space left on device: .../progress.json',
    exit 1) where it should wait for space and go on with the next attempt."""
    pod = make_pod(2)
    filler = small_home / "filler"
    program = (
        f'if [ "$TPUPOD_ATTEMPT" = 1 ] && [ "$TPUPOD_WORKER_ID" = 1 ]; then '
        f"{' '.join(DD)} of={filler} 2>/dev/null; kill -9 $$; fi; "
        'echo "attempt $TPUPOD_ATTEMPT done"'
    )
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--retries", "2", "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if "waiting for space" in line:
            filler.unlink()
            break
    out, err = proc.communicate(timeout=60)
    err = "".join(said) + err
    assert proc.returncode == 0, err
    assert "internal error" not in err and "Traceback" not in err
    assert f"{small_home}" in "".join(said[-1:]), said[-1:]  # the wait names the disk
    assert "[w0] attempt 2 done" in out and "[w1] attempt 2 done" in out, out


def test_a_disk_that_fills_under_a_run_is_said_at_once(
    small_home: Path, make_pod: Callable[..., Pod]
) -> None:
    """The chaos harness (issue 41): the log files' last pages have room for ~100 more
    short lines each, so a disk that filled was said only when they ran out, 10-20 s
    later; the run's logs now stop (and it is said) within a second or two."""
    pod = make_pod(1)
    program = "for i in $(seq 600); do echo step $i; sleep 0.1; done"
    proc = subprocess.Popen(
        tpupod_argv("run", "--pod", pod.name, "--", program),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stdout is not None
    try:
        for line in proc.stdout:
            if "step 20" in line:
                break
        filled = time.monotonic()
        filler = fill(small_home)
        for line in proc.stderr:
            if "cannot write the run's logs" in line:
                break
        said_after = time.monotonic() - filled
        filler.unlink()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert said_after < 3.0, said_after


def test_a_restart_count_on_a_full_disk_does_not_cost_the_restart(small_home: Path) -> None:
    """The chaos harness's 30-minute run (issue 41): the router's keeper died counting a
    restart on a full disk (ENOSPC from router.restarts), and no router ran for 34 s."""
    from tpupod.serve import services  # the serve extra; only this test needs it

    services.count_restarts(small_home, "router", 1)
    filler = fill(small_home)
    try:
        services.count_restarts(small_home, "router", 2)  # said nothing, raised nothing
    finally:
        filler.unlink()
    assert services.restarts(small_home, "router") in (1, 2)


COUNTS_WRITER = """
import sys
from pathlib import Path
from tpupod.serve.router.registry import Counts
counts = Counts([f"h:{i}" for i in range(256)], Path(sys.argv[1]))
if sys.argv[2] == "fill":
    import subprocess
    subprocess.run(["dd", "if=/dev/zero", "bs=1M", "count=8", "of=" + sys.argv[3]],
                   capture_output=True)
for i in range(256):
    view = counts.of(i)
    for k in range(len(view)):
        view[k] = i + k
print("counted", flush=True)
"""


def test_a_router_counts_on_a_full_disk_and_serves_before_its_record_fits(
    small_home: Path, tmp_path: Path
) -> None:
    """The router maps its request counts from a file it sized with ftruncate (a sparse
    file): on a disk that filled since, the first count written into a page with no
    block behind it killed the router with SIGBUS. And a router started on a full disk
    (its keeper's restart during the chaos harness's full disk) died writing its record
    (ENOSPC), so no router ran until space came back and a backoff after."""
    writer = tmp_path / "counts.py"
    writer.write_text(COUNTS_WRITER)
    counts, filler = small_home / "router.counts", small_home / "filler"
    made = subprocess.run(  # made while there is room, the disk filled, then every count
        [sys.executable, str(writer), str(counts), "fill", str(filler)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert made.returncode == 0 and made.stdout == "counted\n", made.stderr[-2000:]
    counts.unlink()
    fill(small_home)  # what the counts took, taken again
    made = subprocess.run(  # no room for the file at all: counted in memory
        [sys.executable, str(writer), str(counts), "-"], capture_output=True, text=True, timeout=30
    )
    assert made.returncode == 0 and made.stdout == "counted\n", made.stderr[-2000:]
    (small_home / "router.token").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "tpupod.serve.router", "--state-dir", str(small_home)]
    argv += ["--port", "0", "--backends", "127.0.0.1:9", "--no-auth"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(argv, **pipes) as router:  # type: ignore[call-overload]
        try:
            assert router.stdout is not None
            line = router.stdout.readline()  # serves on a full disk
            assert line.startswith("ready port="), router.stderr.read() if router.stderr else ""
            port = int(line.split("=")[1])
            health = subprocess.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                 f"http://127.0.0.1:{port}/health"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            assert health.stdout in ("200", "503"), health
            assert not (small_home / "router.json").exists()
            filler.unlink()
            deadline = time.monotonic() + 5
            while not (small_home / "router.json").exists():  # recorded once it fits
                assert time.monotonic() < deadline, "no record once there was room"
                time.sleep(0.1)
        finally:
            router.terminate()
            router.wait(10)


def test_the_agents_record_of_its_servers_waits_for_room(small_home: Path) -> None:
    """The agent writes servers.json at each change of a server; on a full disk the write
    raised into the server's supervisor (which then restarted nothing more)."""
    import asyncio
    import json

    from tpupod.serve.agent.server import Agent  # the serve extra; only this test needs it

    async def main() -> None:
        agent = Agent(small_home)
        filler = fill(small_home)
        agent.record_groups()  # raised nothing
        assert not (small_home / "servers.json").exists()
        filler.unlink()
        for _ in range(60):
            if (small_home / "servers.json").exists():
                break
            await asyncio.sleep(0.1)
        record = json.loads((small_home / "servers.json").read_text())
        assert record == {"groups": [], "servers": []}

    asyncio.run(main())


def test_the_agents_status_says_its_disk_is_full_at_once(small_home: Path) -> None:
    """A full disk under a fleet that logs nothing (the builtin server writes a line at
    each restart, not each request) was seen by nothing: the chaos run's disk filled
    after its trainings ended was named by no one, or by a record written late. The
    agent's status (serve status, the dashboard) says it while it lasts."""
    from fastapi.testclient import TestClient  # the serve extra's

    from tpupod.serve.agent.server import make_app
    from tpupod.serve.backends import Backend
    from tpupod.serve.fleet.record import FleetRecord, ServerRecord
    from tpupod.serve.fleet.status import fleet_status

    auth = {"Authorization": "Bearer t"}
    with TestClient(make_app(small_home, "t")) as client:
        assert client.get("/admin/status", headers=auth).json()["disk_full"] is None
        filler = fill(small_home)
        answer = client.get("/admin/status", headers=auth).json()
        assert answer["disk_full"] == str(small_home)
        filler.unlink()
        assert client.get("/admin/status", headers=auth).json()["disk_full"] is None
    answer["servers"] = [{"name": "a", "ports": [1], "state": "ready", "pid": 5, "restarts": 0}]
    servers = [ServerRecord(worker=0, host="h0", port=1, name="a")]
    record = FleetRecord(
        pod="p", model="m", backend=Backend.COMMAND, python="python3", servers=servers,
        router_host="h0", router_port=9, token="t", started=0.0,
    )  # fmt: skip
    assert fleet_status(record, [answer], {}).servers[0].state == "ready, disk full"


def _ctl(state: Path, *args: str) -> dict[str, Any]:
    """``python -m tpupod.serve.agent.ctl --state-dir STATE ARGS``: its JSON answer."""
    argv = [sys.executable, "-m", "tpupod.serve.agent.ctl", "--state-dir", str(state), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    answer: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return answer


def _router_pid(keeper: int) -> int | None:
    """The router its keeper runs now (a child of the keeper, in its group)."""
    children = psutil.Process(keeper).children()
    return children[0].pid if children else None


def _killed_and_started_again(keeper: int, log: Path, restart: int) -> int:
    """Kill -9 the router the keeper runs; the pid of the one it starts after it, once
    that one serves."""
    killed = _router_pid(keeper)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while (pid := _router_pid(keeper)) in (None, killed) or (
        f"(restart {restart})" not in (said := log.read_text(errors="replace"))
        or said.count("ready port=") < restart + 1  # the new router serves
    ):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
        time.sleep(0.05)
    assert pid is not None
    return pid


def test_a_router_restarted_on_a_full_disk_is_shown_serving_and_its_restarts_counted_later(
    small_home: Path,
) -> None:
    """The new-user trial: a router killed -9 while the disk was full was started again
    by its keeper and served on the keeper's port, but it could not write router.json
    (it waits for room), so 'serve status' said 'the router ended and is being started
    again' for as long as the disk stayed full; and the restarts made meanwhile were
    never counted ('0 restarts' once the disk was freed, though the log said 'restart 1')."""
    from tpupod.serve import services  # the serve extra; only these tests need it

    state = small_home / "serve"
    router = [sys.executable, "-m", "tpupod.serve.router", "--state-dir", str(state)]
    router += ["--port", "0", "--backends", "127.0.0.1:9", "--health-interval", "0.2"]
    started = _ctl(state, "ensure", "--timeout", "30", "router", "--", *router)
    assert "error" not in started, started
    keeper, port, log = started["parent"], started["port"], state / "router.log"
    try:
        filler = fill(small_home)
        _killed_and_started_again(keeper, log, 1)
        pid = _killed_and_started_again(keeper, log, 2)  # two restarts while it is full
        seen = _ctl(state, "view")
        assert seen.get("status") == 200, seen  # the new router answers on the same port
        assert seen["restarts"] == 2, seen
        assert "router.json" in seen["record"] and "full" in seen["record"], seen
        assert seen["body"]["health"]["127.0.0.1:9"]["state"] in ("up", "down")
        filler.unlink()
        deadline = time.monotonic() + 10
        while (
            services.restarts(state, "router") != 2 or services.read_info(state, "router") is None
        ):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.1)
        record = services.read_info(state, "router")
        assert record is not None and record["pid"] == pid and record["port"] == port
        seen = _ctl(state, "view")
        assert seen.get("status") == 200 and "record" not in seen and seen["restarts"] == 2, seen
        said = log.read_text(errors="replace")
        assert "cannot write router.json (No space left on device)" in said, said[-2000:]
        assert "wrote router.json after " in said, said[-2000:]  # its record came late
    finally:
        stopped = _ctl(state, "stop", "router")
        assert stopped.get("stopped"), stopped


CHATTY = """
import itertools, time
for i in itertools.count():
    print(f"{'x' * 300} line {i}", flush=True)  # 30 KB a second: past a page soon
    time.sleep(0.01)
"""


def test_a_servers_output_goes_on_to_its_log_after_the_disk_was_full(
    small_home: Path, tmp_path: Path
) -> None:
    """The agent copies each server's output to its log: a write that failed on a full
    disk ended the copying task, and no one read the server's pipe again; once its 1 MiB
    filled, every write of the server blocked (a builtin server's log line on each
    request: it hung). Lines that do not fit are dropped, said once, and the copy goes on."""
    import asyncio

    from tpupod.serve.agent.supervisor import ManagedServer  # the serve extra's
    from tpupod.serve.backends import Backend, ServerSpec

    chatty = tmp_path / "chatty.py"
    chatty.write_text(CHATTY)
    spec = ServerSpec(
        name="s0", backend=Backend.COMMAND, host="127.0.0.1", ports=(1,), model="m",
        command=f"{sys.executable} {chatty}",
    )  # fmt: skip
    server = ManagedServer(spec, small_home / "logs", {"PATH": "/usr/bin:/bin"})

    def last_line(text: str) -> int:
        return max((int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.rsplit(" ", 2)[-2:-1] == ["line"]), default=-1)  # fmt: skip

    async def main() -> tuple[int, str, Any, Any]:
        server.start()
        log = server.log_path
        for _ in range(600):
            if log.exists() and last_line(log.read_text()) >= 20:
                break
            await asyncio.sleep(0.05)
        filler = fill(small_home)
        await asyncio.sleep(1.0)  # lines come and find no room
        while_full = server.status()["disk_full"]  # said where serve status shows it
        full = last_line(log.read_text())
        filler.unlink()
        for _ in range(200):
            await asyncio.sleep(0.05)
            if last_line(log.read_text()) > full + 20:
                break
        text = log.read_text()
        after = server.status()["disk_full"]
        await server.stop(2.0)
        return full, text, while_full, after

    full, text, while_full, after = asyncio.run(main())
    assert last_line(text) > full + 20, text[-2000:]  # lines written after there was room
    assert "line(s) lost: the disk under" in text, text[-2000:]
    assert while_full["lines_lost"] > 0 and time.time() - while_full["since"] < 10, while_full
    assert after is None
