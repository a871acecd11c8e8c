"""Small pieces: worker selections, line splitting, exit statuses, gloo's chatter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tpupod.errors import UsageError
from tpupod.launch.run import Chatter
from tpupod.pod.selection import parse_worker_selection, select_ids
from tpupod.transport import ExitStatus
from tpupod.transport.lines import LineSplitter


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0", [0]),
        ("0,2-3", [0, 2, 3]),
        ("3,1,1", [1, 3]),
        (" 1 - 2 ", [1, 2]),
        ("0-7", list(range(8))),
    ],
)
def test_selection(text: str, ids: list[int]) -> None:
    assert parse_worker_selection(text, 8) == ids


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("8", "worker 8 does not exist"),
        ("x", "is not a number"),
        ("3-1", "runs backwards"),
        ("-1", "not a number"),
        ("1,", "is not a number"),
        ("2-9", "worker 9 does not exist"),
    ],
)
def test_bad_selection(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_worker_selection(text, 8)


@pytest.mark.parametrize("text", ["", " ", "\t"])
def test_an_empty_selection_is_not_all(text: str) -> None:
    with pytest.raises(UsageError, match="empty worker selection"):
        select_ids(text, 4)
    assert select_ids(None, 3) == select_ids("all", 3) == [0, 1, 2]


def test_lines_split_across_chunks_and_at_the_end() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"hel") == []
    assert splitter.feed(b"lo\nwor") == ["hello"]
    assert splitter.feed(b"ld\r\n\n") == ["world", ""]
    assert splitter.feed(b"tail") == []
    assert splitter.finish() == ["tail"]
    assert splitter.finish() == []


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert LineSplitter().feed(b"caf\xe9\n") == ["caf\ufffd"]


def test_endless_line_is_cut() -> None:
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"a" * 25) == ["a" * 10, "a" * 10]
    assert splitter.finish() == ["a" * 5]


def test_a_long_line_is_cut_at_a_characters_edge() -> None:
    splitter = LineSplitter(max_line=10)
    assert splitter.feed("aaaaaaaaa\u00e9bbb".encode()) == ["aaaaaaaaa"]  # é's 2 bytes kept whole
    assert splitter.finish() == ["\u00e9bbb"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_progress_bar_streams_its_state_at_most_every_interval() -> None:
    """A bar redraws its line after a bare \\r (tqdm, pip, downloads): each state was held
    until the bar's newline and came as one line of every state, \\r and all."""
    clock = Clock()
    splitter = LineSplitter(progress_every=1.0, clock=clock)
    assert splitter.feed(b"\r  0%|   | 0/3") == ["  0%|   | 0/3"]  # the first state at once
    clock.now = 0.4
    assert splitter.feed(b"\r 33%|#  | 1/3") == []  # within the interval: held back
    clock.now = 1.2
    assert splitter.feed(b"\r 66%|## | 2/3") == [" 66%|## | 2/3"]  # the latest, not 33%
    clock.now = 1.5
    assert splitter.feed(b"\r100%|###| 3/3") == []
    assert splitter.feed(b"\n") == ["100%|###| 3/3"]  # the bar's end always shows
    assert splitter.feed(b"done\r\n") == ["done"]
    assert splitter.finish() == []


def test_a_bar_state_is_shown_once_and_a_wipe_is_not_a_state() -> None:
    clock = Clock()
    splitter = LineSplitter(progress_every=1.0, clock=clock)
    assert splitter.feed(b"\rstep 9/9") == ["step 9/9"]
    clock.now = 5
    assert splitter.feed(b"\n") == []  # its newline: shown already
    assert splitter.feed(b"\rload 1\r      \r") == ["load 1"]  # the spaces wipe the line
    clock.now = 10
    assert splitter.feed(b"next\n") == ["next"]
    assert splitter.feed(b"\rlast") == ["last"]
    assert splitter.finish() == []  # ended without a newline: shown already


def test_a_line_cut_exactly_at_the_buffers_end_is_cut() -> None:
    """A line reaching the limit with the buffer's last byte read past the buffer."""
    splitter = LineSplitter(max_line=4)
    assert splitter.feed(b"abcd") == ["abcd"]
    assert splitter.feed("ab\u00e9".encode()) == ["ab\u00e9"]
    assert splitter.feed("abc\u00e9".encode()) == ["abc"]  # é would be split: kept for later
    assert splitter.finish() == ["\u00e9"]


def test_a_bar_that_stops_moving_is_shown_where_it_stands_once_due() -> None:
    clock = Clock()
    splitter = LineSplitter(progress_every=1.0, clock=clock)
    assert splitter.due_in() is None and splitter.due() == []
    assert splitter.feed(b"\r 1/3") == [" 1/3"]
    assert splitter.due_in() is None  # nothing held back
    clock.now = 0.3
    assert splitter.feed(b"\r 2/3") == []  # held back: then the bar stops
    assert splitter.due_in() == pytest.approx(0.7)
    assert splitter.due() == []
    clock.now = 1.0
    assert splitter.due_in() == 0.0 and splitter.due() == [" 2/3"]
    assert splitter.due_in() is None and splitter.due() == []  # once
    assert splitter.feed(b"\n") == []  # its end: shown already


def test_a_carriage_return_split_from_its_newline_is_one_line_end() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"one\r") == []  # \r\n or a redraw: the next byte says
    assert splitter.feed(b"\ntwo\r") == ["one"]
    assert splitter.finish() == ["two"]


def test_exit_status() -> None:
    assert ExitStatus(0).ok and ExitStatus(0).describe() == "exit 0"
    assert ExitStatus(None, 15).describe() == "killed by SIGTERM"
    assert ExitStatus(None, 15).shell_code == 143
    assert ExitStatus(None, 99).describe() == "killed by signal 99"


def _gloo_cases() -> list[tuple[list[str], list[str]]]:
    """Lines gloo left in workers' logs in real runs: its message comes in pieces (text,
    numbers, newline) that other output (another gloo thread, the program's print) lands
    between."""
    text = (Path(__file__).parent / "fixtures" / "gloo_chatter.txt").read_text()
    cases = []
    for block in text.split("===\n")[:-1]:
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        arrow = lines.index("=>")
        cases.append(
            ([json.loads(x) for x in lines[:arrow]], [json.loads(x) for x in lines[arrow + 1 :]])
        )
    return cases


@pytest.mark.parametrize(("lines", "shown"), _gloo_cases())
def test_chatter_cuts_gloo_pieces_out_wherever_they_land(
    lines: list[str], shown: list[str]
) -> None:
    chatter = Chatter()
    assert [kept for line in lines if (kept := chatter(line)) is not None] == shown


def test_write_atomic_writes_whole_files_and_leaves_nothing_beside(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tpupod.base.files import write_atomic

    dest = tmp_path / "sub" / "results.json"
    write_atomic(dest, [b"ab", memoryview(b"cd")], mode=0o644, sync=False)
    assert dest.read_bytes() == b"abcd" and dest.stat().st_mode & 0o777 == 0o644
    # many writers of one file at once: each rename brings one whole file (a fixed staging
    # name, as bench/storage.py had, let one writer's rename take another's half file)
    texts = [str(i) * 100_000 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda text: write_atomic(dest, text), texts * 4))
    assert dest.read_text() in texts and dest.stat().st_mode & 0o777 == 0o600

    def broken() -> Iterator[bytes]:
        yield b"half"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(dest, broken())
    assert dest.read_text() in texts  # the old file, whole
    assert [p.name for p in dest.parent.iterdir()] == ["results.json"]


def test_a_tab_or_escape_in_a_last_line_keeps_the_summary_aligned() -> None:
    """A new user's trial: a tab in a worker's last line pushed its row out of the table."""
    import io

    from tpupod.fanout.report import print_summary
    from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
    from tpupod.pod.record import Worker

    workers = [Worker(id=i, hostname="vm", internal_address="127.0.0.1") for i in range(2)]
    results = [
        WorkerResult(workers[0], Outcome.FAILED, 0.2, ExitStatus(1), tail=("a\tb\x1b[31mred",)),
        WorkerResult(workers[1], Outcome.FAILED, 0.2, ExitStatus(1), tail=("a b",)),
    ]
    out = io.StringIO()
    print_summary(FanoutResult("x", results, 0.3, failure_order=[0, 1]), out, "run", color=False)
    rows = [line for line in out.getvalue().splitlines() if line.startswith(("w0 ", "w1 "))]
    assert rows[0].endswith("a b[31mred") and "\t" not in rows[0] and "\x1b" not in rows[0]
    assert rows[0].index("a b") == rows[1].index("a b")


def test_a_stopped_runs_ending_counts_its_unfinished_workers_in_words() -> None:
    """'stopped by SIGTERM: 1 workers did not finish' (a trial's line)."""
    import signal

    from tpupod.fanout.results import FanoutResult, Outcome, WorkerResult
    from tpupod.pod.record import Worker

    workers = [Worker(id=i, hostname="vm", internal_address="127.0.0.1") for i in range(3)]

    def stopped(n: int) -> str:
        results = [
            WorkerResult(w, Outcome.INTERRUPTED if w.id < n else Outcome.OK, 0.1) for w in workers
        ]
        ending = FanoutResult("x", results, 0.2, interrupt_signal=signal.SIGTERM).ending()
        return ending.why or ""

    assert stopped(1) == "stopped by SIGTERM: 1 worker did not finish"
    assert stopped(2) == "stopped by SIGTERM: 2 workers did not finish"
    assert stopped(0) == "stopped by SIGTERM: every worker ended by itself"


def test_a_pod_user_names_the_run_it_is() -> None:
    """One reading of a use's run for `cancel` without RUN and `down`'s refusal."""
    from tpupod.pod.users import PodUser  # this test alone

    plain = PodUser(1, "tpupod run 20261206-103000-ab12", 0.0)
    retries = PodUser(
        2,
        "run 20261206-103001-cd34 (tpupod run --retries)",
        0.0,
        stop="tpupod cancel --pod dev 20261206-103001-cd34",
    )
    runner = PodUser(3, "a job runner ('tpupod jobs worker --pod dev')", 0.0)
    assert [u.run_id for u in (plain, retries, runner)] == [
        "20261206-103000-ab12",
        "20261206-103001-cd34",
        "",
    ]


def test_a_ctrl_c_inside_a_class_definition_is_an_interrupt_not_an_internal_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A trial: Ctrl-C 0.5 s into 'jobs worker' (pydantic making a model's class) was
    'internal error: RuntimeError: Error calling __set_name__ ...' (exit 70): Python wraps
    what __set_name__ raises, a KeyboardInterrupt too."""
    from tpupod.fanout.report import report_failure  # this test alone

    class Interrupted:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    with pytest.raises(RuntimeError) as wrapped:
        type("Model", (), {"field": Interrupted()})
    assert report_failure(wrapped.value) == 130
    assert capsys.readouterr().err == ""


def test_down_s_refusal_says_what_force_does_to_the_users_it_names() -> None:
    """A trial: 'down' refused during a 'serve up' with a hint about job runners and runs."""
    from tpupod.pod.lifecycle import _in_use  # this test alone
    from tpupod.pod.users import PodUser

    serving = _in_use("dev", [PodUser(7, "tpupod serve up", 0.0)])
    assert serving.hint == (
        "stop it first (kill -TERM 7), or add --force: a 'serve up' stops (the fleet stops "
        "with the pod)"
    )
    runner = PodUser(8, "a job runner ('tpupod jobs worker --pod dev')", 0.0)
    both = _in_use("dev", [PodUser(9, "tpupod run 20261206-1", 0.0), runner])
    assert both.hint == (
        "stop it first ('tpupod cancel 20261206-1'), or add --force: a run stops, a job "
        "runner gives its running job back to the queue"
    )
