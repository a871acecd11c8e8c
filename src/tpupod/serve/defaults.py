"""The serving fleet's defaults, in one place: the CLI, the fleet record, the agent, the
router and its registry all read them from here (light: nothing is imported)."""

from __future__ import annotations

AGENT_PORT = 9010
ROUTER_PORT = 9100  # on worker 0; a local pod's router takes any free port
BASE_PORT = 31000  # the first server port of a worker
POLICY = "least_outstanding"
ROUTER = "builtin"  # or "sgl": sgl-router (the sglang-router package)
SGL_POLICY = "cache_aware"  # sgl-router's own default: a prefix goes where it was cached
ROUTER_RETRIES = 2  # another server, for a connect error or a 5xx before anything was sent
# a request that no server could take waits this long for one (every replica restarting)
ROUTER_HOLD_S = 30.0
RESTART_BACKOFF_S = 1.0  # the first wait before a server is restarted (it doubles)
SMALLEST_SPAN = 128  # the builtin engine's first attention span (slots.attention_spans)
# the split builtin server restarts an engine that sends nothing this long with work in flight
# (a turn is a decode call or a prefill chunk: well under a second to a few seconds)
STALL_TIMEOUT_S = 60.0

# the registry's health checks
HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 1.0
FALL = 2  # failed checks in a row that take a backend out
RISE = 2  # passed checks in a row that bring it back
EJECT_AFTER = 3  # failed requests in a row that take it out at once
COOLDOWN_S = 5.0  # before an ejected backend gets a trial request
