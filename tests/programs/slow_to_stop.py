"""A process group whose members outlive its leader on TERM, for the tests of stopping one.

``python slow_to_stop.py MARK`` starts two children in its own process group: one that,
on TERM, takes 0.5 s to clean up and then writes MARK; one that ignores TERM. Once both
have their handlers it prints ``children PID PID`` and ``ready``, then sleeps; the leader
itself ends at once on TERM. Run in a process that is already a group's leader (a code
job in a pool process) it does the same from there.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def child(mode: str, mark: str) -> None:
    def clean_up(*_: object) -> None:
        time.sleep(0.5)
        Path(mark).write_text("cleaned up\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, clean_up if mode == "cleanup" else signal.SIG_IGN)
    print("set", flush=True)
    while True:
        time.sleep(1)


def main(mark: str) -> None:
    kids = [
        subprocess.Popen([sys.executable, __file__, "--child", mode, mark], stdout=subprocess.PIPE)
        for mode in ("cleanup", "ignore")
    ]
    for kid in kids:
        assert kid.stdout is not None and kid.stdout.readline() == b"set\n"
    print("children", *(kid.pid for kid in kids), flush=True)
    print("ready", os.getpgrp(), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
