"""The README's command blocks, run as written against a fresh state directory.

Every ``$ command`` of a ```console block, and every line of a bare ``` block, is run
with bash in the block's setting (below), and must exit 0; where the README shows output,
each line it shows must appear (loosely: durations, launch ids, the state directory and
the README machine's hostname may differ; ``...`` ends what is compared). Commands that
cannot run here are listed in NOT_RUN with the reason; a README command in neither is a
failure, so a new block or command cannot go untested.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import pod_processes
from tpupod.holder.client import stop_holder
from tpupod.pod.state import StateDir
from tpupod.sim import SimPod

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

TOUR = "A tour of the CLI"
SSH = "SSH pods: hosts that already exist"
GCP = "Cloud TPUs: no gcloud needed"
RUN = "Lockstep programs: `tpupod run`"
SLICES = "Slices: one run across several slices"
JOBS = "Queued jobs: `tpupod jobs`"
BENCH = "Checkpoint benchmarks: `tpupod bench checkpoint`"
EXTRACT = "Activation extraction: `tpupod extract`"
SERVE = "Serving a model: `tpupod serve`, `tpupod fanout`"
TOP = "tpupod"  # the block under the title
INSTALL = "Install"
MODEL = "The model: Qwen2 / Qwen2.5 / Qwen3 in JAX"

NEEDS_CLOUD = "needs a TPU in Google Cloud, which cannot be reached from here"
NOT_RUN = {
    (TOP, "make test"): "runs this suite, which runs this test",
    (TOP, "make test-fast"): "runs this suite's unit tier",
    (INSTALL, "pip install -e ."): (
        "would change the venv running this test; scripts/newcomer.sh (CI, before make test)"
        " installs it into a fresh venv and runs its commands"
    ),
    (INSTALL, "pip install -e '.[all]'"): "what this suite's venv holds (.[test] includes it)",
    (SSH, "tpupod sync --repo-url https://github.com/google/orbax --pr 123"): (
        "fetches from GitHub; the tests reach no network (sync from a server is tested"
        " against a local repository in test_ops.py)"
    ),
    (GCP, "tpupod up --name big --gcp --tpu-type v5litepod-64 --zone us-west4-a"): NEEDS_CLOUD,
    (GCP, "tpupod exec -- 'python -c \"import jax; print(jax.device_count())\"'"): NEEDS_CLOUD,
    (GCP, "tpupod status"): NEEDS_CLOUD,
    (GCP, "tpupod down"): NEEDS_CLOUD,
    (BENCH, "tpupod bench checkpoint -c examples/bench_checkpoint.yaml --baseline latest"): (
        "its verdict depends on how this shared 2-core machine's load changes between the"
        " two runs; test_bench_checkpoint.py runs a config twice (no regression) and against"
        " a doctored baseline (a regression)"
    ),
}

# What may differ between the README's output and ours: (name, as shown, as matched).
VARIABLE = [
    ("launch_id", r"\d{8}-\d{6}-[0-9a-f]{6}", r"\d{8}-\d{6}-[0-9a-f]{6}"),
    ("duration", r"\d+\.\d+s\b", r"\d+(?:\.\d+)?s"),
    ("state_dir", r"~/\.local/state/tpupod", r"\S+"),
    ("hostname", r"\bvm\b", r"\S+"),
]
VARIABLE_RE = re.compile("|".join(f"(?P<{name}>{shown})" for name, shown, _ in VARIABLE))
MATCHED_AS = {name: matched for name, _, matched in VARIABLE}


@dataclass
class Command:
    line: str  # as the README shows it, comment and all
    shown: list[str] = field(default_factory=list)  # the output lines the README shows

    @property
    def key(self) -> str:
        """The command without its trailing comment, as NOT_RUN names it."""
        quote = ""
        for i, char in enumerate(self.line):
            if quote:
                quote = "" if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#" and self.line[i - 1].isspace():
                return self.line[:i].strip()
        return self.line.strip()


@dataclass
class Block:
    heading: str
    commands: list[Command]


def readme_blocks(text: str) -> Iterator[Block]:
    """The console blocks (``$ `` lines and their output) and bare blocks (one command a line)."""
    heading = ""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.strip() in ("```console", "```"):
            console = line.strip() == "```console"
            indent = len(line) - len(line.lstrip())  # a block inside a list item
            body = []
            for inner in lines:
                if inner.strip() == "```":
                    break
                body.append(inner[indent:])
            yield Block(heading, console_commands(body) if console else bare_commands(body))
        elif line.startswith("```"):  # ```yaml, ```python: not commands
            for inner in lines:
                if inner.strip() == "```":
                    break


def console_commands(body: list[str]) -> list[Command]:
    commands: list[Command] = []
    for line in body:
        if line.startswith("$ "):
            commands.append(Command(line[2:]))
        elif line.strip() and commands:
            commands[-1].shown.append(line)
    return commands


def bare_commands(body: list[str]) -> list[Command]:
    return [Command(line) for line in body if line.strip()]


def blocks() -> dict[str, list[Command]]:
    found: dict[str, list[Command]] = {}
    for block in readme_blocks(README.read_text()):
        found.setdefault(block.heading, []).extend(block.commands)
    return found


def line_pattern(shown: str) -> re.Pattern[str] | None:
    """A regex for one output line the README shows; None for a bare ``...``."""
    prefix_only = "..." in shown
    text = shown.partition("...")[0].rstrip() if prefix_only else shown
    if not text.strip():
        return None
    parts, pos = [], 0
    for match in VARIABLE_RE.finditer(text):
        parts += [literal(text[pos : match.start()]), MATCHED_AS[match.lastgroup or ""]]
        pos = match.end()
    parts.append(literal(text[pos:]))
    return re.compile("".join(parts) + ("" if prefix_only else r"\s*$"))


def literal(text: str) -> str:
    """Text as a regex in which any run of spaces matches any run of whitespace."""
    words = [re.escape(word) for word in text.split()]
    if not words:
        return r"\s+" if text else ""
    lead = r"\s+" if text[0].isspace() else ""
    trail = r"\s+" if text[-1].isspace() else ""
    return lead + r"\s+".join(words) + trail


def unmatched(shown: list[str], output: str) -> list[str]:
    """The README's lines that no line of the output matches."""
    actual = [line.strip() for line in output.splitlines()]
    missing = []
    for line in shown:
        pattern = line_pattern(line.strip())
        if pattern is not None and not any(pattern.match(a) for a in actual):
            missing.append(line)
    return missing


@dataclass
class Setting:
    """Where a block's commands run, and what in them stands for something here."""

    cwd: Path
    env: dict[str, str]
    replace: dict[str, str] = field(default_factory=dict)
    timeout: float = 120


def run_block(heading: str, setting: Setting) -> list[subprocess.CompletedProcess[str]]:
    commands = blocks()[heading]
    assert commands, f"no commands under {heading!r} in the README"
    for old in setting.replace:
        assert any(old in c.line for c in commands), f"{old!r} is no longer under {heading!r}"
    done = []
    for command in commands:
        if (heading, command.key) in NOT_RUN:
            continue
        line = command.line
        for old, new in setting.replace.items():
            line = line.replace(old, new)
        proc = subprocess.run(
            ["bash", "-c", line],
            cwd=setting.cwd,
            env=setting.env,
            capture_output=True,
            text=True,
            timeout=setting.timeout,
        )
        report = f"$ {line}\n(exit {proc.returncode})\n{proc.stdout}{proc.stderr}"
        assert proc.returncode == 0, report
        missing = unmatched(command.shown, proc.stdout + proc.stderr)
        assert not missing, "the README shows lines the output lacks:\n" + "\n".join(
            [*missing, "---", report]
        )
        done.append(proc)
    return done


def environment(**extra: str) -> dict[str, str]:
    """os.environ (TPUPOD_HOME is the test's, from state_home) with this venv's tpupod first."""
    env = {**os.environ, **extra}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for name in ("NO_COLOR", "FORCE_COLOR", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        env.pop(name, None)
    return env


def take_down(env: dict[str, str], *pods: str) -> None:
    for pod in pods:
        subprocess.run(["tpupod", "down", "--pod", pod], env=env, capture_output=True, timeout=60)
        stop_holder(StateDir(), pod)
        for proc in pod_processes(pod):
            proc.kill()


# -- the tests ---------------------------------------------------------------------------


def test_every_command_is_run_or_listed_with_a_reason() -> None:
    known = {TOP, INSTALL, TOUR, SSH, GCP, RUN, SLICES, BENCH, JOBS, EXTRACT, SERVE}
    found = blocks()
    assert set(found) <= known, f"README blocks this test does not run: {set(found) - known}"
    listed = {(heading, command.key) for heading, cmds in found.items() for command in cmds}
    stale = set(NOT_RUN) - listed
    assert not stale, f"NOT_RUN names commands the README no longer has: {stale}"


# Commands that need no pod, or name theirs in an argument of their own.
NO_POD = (
    *("tpupod list", "tpupod up", "tpupod extract convert-arc", "tpupod dashboard"),
    *("tpupod jobs wait", "tpupod jobs logs", "tpupod jobs show", "tpupod down --pod"),
)


def test_reading_top_to_bottom_never_meets_another_pods_spec_or_two_unnamed_pods() -> None:
    """A reader who runs every command in order, in one state directory: each section's
    'up --name dev' had another shape, so the second met "pod 'dev' exists with a different
    spec", and a command without --pod met "2 pods exist, say which one"."""
    up: dict[str, str] = {}
    for block in readme_blocks(README.read_text()):
        for command in block.commands:
            words = command.key.split()
            if words[:3] == ["tpupod", "up", "--name"] and "--dry-run" not in words:
                name, shape = words[3], " ".join(words[4:])
                assert up.get(name, shape) == shape, f"{block.heading}: {command.key}: {up}"
                up[name] = shape
            elif words[:2] == ["tpupod", "down"]:
                up.pop(words[3] if "--pod" in words else next(iter(up)), None)
            elif command.key.startswith("tpupod ") and not command.key.startswith(NO_POD):
                named = "--pod" in words or "--db" in words
                assert named or len(up) <= 1, f"{block.heading}: {command.key}: pods {list(up)}"
    assert up == {}, f"the README leaves pods up: {up}"


def test_the_output_matcher() -> None:
    shown = ["exec on dev: 4/4 ok in 0.01s", "0       vm        127.0.0.1  -", "[w0] a...", "..."]
    output = "[w0] a b\n0  host-7  127.0.0.1  -\nexec on dev: 4/4 ok in 12.5s\n"
    assert unmatched(shown, output) == []
    assert unmatched(["exec on dev: 4/4 ok in 0.01s"], "exec on dev: 3/4 ok in 1s") != []
    assert Command("tpupod status   # the TPU's state").key == "tpupod status"
    assert Command("tpupod exec -- 'echo #1' # one").key == "tpupod exec -- 'echo #1'"


@pytest.mark.local
@pytest.mark.timeout(300)
def test_the_tour(state_home: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--steps', type=int)\n"
        "print(f'trained {parser.parse_args().steps} steps')\n"
    )
    env = environment()
    try:
        run_block(TOUR, Setting(project, env))
    finally:
        take_down(env, "dev")


@pytest.mark.local
@pytest.mark.timeout(300)
def test_lockstep_run_and_logs(state_home: Path) -> None:
    env = environment()
    try:
        *_, logs, _down = run_block(RUN, Setting(REPO, env))
    finally:
        take_down(env, "dev")
    assert "[w1]" in logs.stdout and "[w0]" not in logs.stdout


@pytest.mark.local
@pytest.mark.timeout(300)
def test_slices(state_home: Path) -> None:
    env = environment()
    try:
        _up, run, exec_, _down = run_block(SLICES, Setting(REPO, env))
    finally:
        take_down(env, "ms")
    assert "mesh {'data': 2, 'fsdp': 4}" in run.stdout
    assert sorted(exec_.stdout.split()) == ["1", "1", "[w2]", "[w3]"]


@pytest.mark.local
@pytest.mark.timeout(400)
def test_serving(state_home: Path) -> None:
    env = environment()
    try:
        run_block(SERVE, Setting(REPO, env, timeout=300))
    finally:
        take_down(env, "dev", "four")


@pytest.mark.local
@pytest.mark.timeout(120)
def test_queued_jobs(state_home: Path) -> None:
    env = environment()
    try:
        run_block(JOBS, Setting(REPO, env))
    finally:
        take_down(env, "dev")


@pytest.mark.local
@pytest.mark.timeout(300)
def test_checkpoint_benchmark(state_home: Path, tmp_path: Path) -> None:
    env = environment()
    config = str(REPO / "examples" / "bench_checkpoint.yaml")
    replace = {"examples/bench_checkpoint.yaml": config}
    try:
        run_block(BENCH, Setting(tmp_path, env, replace))
    finally:
        take_down(env, "dev")
    assert list(tmp_path.glob("bench-results/small-pytree-sweep/*/results.json"))


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks under ``heading``, as written."""
    found, current, lines = [], "", iter(README.read_text().splitlines())
    for line in lines:
        if line.startswith("#"):
            current = line.lstrip("#").strip()
        elif line.strip() == "```python" and current == heading:
            found.append("\n".join(iter(lambda: next(lines), "```")))
    return found


@pytest.mark.local
@pytest.mark.timeout(300)
def test_the_model_section_runs_on_the_shipped_checkpoint() -> None:
    """It named a checkpoint the repository does not ship (/tmp/model/qwen2.5-0.5b)."""
    (code,) = python_blocks(MODEL)
    env = environment(JAX_NUM_CPU_DEVICES="4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    shape, texts, chat = proc.stdout.splitlines()
    assert shape == "(2, 8, 64)" and texts.startswith("[") and chat.startswith("[")


@pytest.mark.local
def test_the_gcp_dry_run(state_home: Path, tmp_path: Path) -> None:
    # no project and no credentials: the request shows PROJECT_ID, as in the README
    env = environment(GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "none.json"))
    run_block(GCP, Setting(tmp_path, env))
    listed = subprocess.run(["tpupod", "list"], env=env, capture_output=True, text=True)
    assert listed.stdout == ""  # nothing was created


def user_project(root: Path) -> Path:
    """A user's repository: the files the SSH block's commands name, committed."""
    project = root / "bench-project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "bench.yaml").write_text("steps: 3\n")
    (project / "setup_tpu.sh").write_text('echo "set up $(hostname)"\n')
    (project / "bench.py").write_text(
        "import argparse, os, socket\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--config')\n"
        "config = open(parser.parse_args().config).read().strip()\n"
        "os.makedirs('results', exist_ok=True)\n"
        "with open('results/bench.txt', 'w') as f:\n"
        "    f.write(f'{socket.gethostname()} {config}\\n')\n"
        "print(f'{socket.gethostname()}: {config}')\n"
    )
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "bench"], check=True)
    return project


@pytest.mark.timeout(300)
def test_ssh_pods(state_home: Path, tmp_path: Path, sim_hosts_up: SimPod) -> None:
    project = user_project(tmp_path)
    hosts = sim_hosts_up.hosts
    replace = {  # the README's example hosts and key are these simulated hosts and their key
        "root@10.130.0.21,root@10.130.0.20": f"root@{hosts[0].address},root@{hosts[1].address}",
        "~/.ssh/google_compute_engine": str(sim_hosts_up.key),
    }
    env = environment()
    try:
        run_block(SSH, Setting(project, env, replace))
    finally:
        take_down(env, "lab")
    for worker in (0, 1):
        collected = project / "results" / f"worker-{worker}" / "results" / "bench.txt"
        assert collected.read_text() == f"{hosts[worker].hostname} steps: 3\n"


@pytest.mark.local
@pytest.mark.timeout(600)
def test_make_demo(state_home: Path) -> None:
    """``make demo``: its local part anywhere, and as root its SSH part too. Run with the
    user's TPUPOD_HOME, it leaves that state directory as it found it: it left sim.json and
    collected/ there, and its pods' names ('demo', 'lab') are the user's pods' to keep."""
    env = environment()
    for pod in ("demo", "lab"):  # the user's own, by the names the demo would use
        assert (
            subprocess.run(["tpupod", "up", "--name", pod, "--local", "1"], env=env).returncode == 0
        )
    before = tree(state_home)
    # as on a shared machine, another fleet listens on serve up's default ports: the
    # newcomer's first command failed there ('ports in use: w0 :31000', the trial of 41)
    other = socket.socket()
    with contextlib.suppress(OSError):  # taken already: the same case
        other.bind(("127.0.0.1", 31000))
        other.listen()
    try:
        (demo,) = run_block(TOP, Setting(REPO, env, timeout=300))
        if os.geteuid() == 0:
            assert "An SSH pod" in demo.stdout and "Skipping the SSH part" not in demo.stdout
        assert tree(state_home) == before
    finally:
        other.close()
        take_down(env, "demo", "lab")


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder``: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if not p.is_socket()
    }


@pytest.mark.local
def test_activation_extraction(state_home: Path, tmp_path: Path) -> None:
    env = environment()
    replace = {  # run in a scratch folder: the outputs stay out of the repository
        "examples/arc_tasks.json": str(REPO / "examples" / "arc_tasks.json"),
        "tests/fixtures/qwen2-tiny": str(REPO / "tests" / "fixtures" / "qwen2-tiny"),
    }
    try:
        run_block(EXTRACT, Setting(tmp_path, env, replace))
    finally:
        take_down(env, "dev")
