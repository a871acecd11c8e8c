"""A shell snippet that waits while any of some files is locked (by fcntl/lockf or flock).

It reads ``/proc/locks`` rather than calling ``fuser`` or ``lsof``, which a
fresh host may not have. A lock there is named by device and inode, as
``MAJOR:MINOR:INODE`` (major and minor in hex).
"""

from __future__ import annotations

# Format with locks=<quoted paths>, limit=<seconds>, code=<exit code when giving up>.
WAIT_FOR_LOCKS = """lock_holder() {{
  for f in {locks}; do
    [ -e "$f" ] || continue
    d=$((0x$(stat -c %D "$f"))); i=$(stat -c %i "$f")
    key=$(printf '%02x:%02x:%s' $(( (d >> 8) & 0xfff )) $(( (d & 0xff) | ((d >> 12) & 0xfff00) )) "$i")
    pid=$(awk -v k="$key" '$2 != "->" && $6 == k {{ print $5; exit }}' /proc/locks)
    if [ -n "$pid" ]; then echo "$f $pid"; return 0; fi
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
