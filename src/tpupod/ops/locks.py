"""A shell snippet that waits while any of some files is locked (by fcntl/lockf or flock).

It reads ``/proc/locks`` rather than calling ``fuser`` or ``lsof``, which a
fresh host may not have. A lock there is named ``MAJOR:MINOR:INODE``; the
device is not compared, since on overlay filesystems (containers) ``stat``
reports the overlay's device and ``/proc/locks`` the real one: a holder
found by inode is confirmed by its open file descriptors instead.
"""

from __future__ import annotations

# Format with locks=<quoted paths>, limit=<seconds>, code=<exit code when giving up>.
WAIT_FOR_LOCKS = """lock_holder() {{
  for f in {locks}; do
    [ -e "$f" ] || continue
    i=$(stat -c %i "$f")
    # Match the inode (an overlay reports another device than /proc/locks), then confirm
    # that the process really has this file open.
    for pid in $(awk -v i=":$i" '$2 != "->" && substr($6, length($6) - length(i) + 1) == i {{ print $5 }}' /proc/locks); do
      for fd in /proc/"$pid"/fd/*; do
        if [ "$(readlink "$fd" 2>/dev/null)" = "$f" ]; then echo "$f $pid"; return 0; fi
      done
    done
  done
  return 1
}}
waited=0
while held=$(lock_holder); do
  set -- $held
  if [ "$waited" -ge {limit} ]; then
    echo "gave up after {limit}s: $1 is still locked by pid $2" >&2
    exit {code}
  fi
  if [ $((waited % 10)) = 0 ]; then
    echo "waiting for $1 (locked by pid $2, $(ps -o comm= -p "$2" 2>/dev/null || echo '?')) ${{waited}}s"
  fi
  sleep 1
  waited=$((waited + 1))
done"""
