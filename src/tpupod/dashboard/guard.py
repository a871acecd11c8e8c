"""Who may talk to the dashboard: the bind rule, the Host header check, and the token and
same-origin rule of the few actions (POSTs).

Ray's dashboard listened on 0.0.0.0 without auth and its job API ran anyone's code
(ShadowRay); a page that answers any Host header can be reached from a web page through DNS
rebinding. So: loopback by default, any other bind only with a token; a request naming a
host we do not serve gets 400; an action needs the bearer token and no foreign Origin.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Awaitable, Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tpupod.errors import UsageError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse a bind beyond this machine without a token (before anything listens)."""
    if token or is_loopback(host):
        return
    raise UsageError(
        f"the dashboard would listen on {host} without a token: anyone who can reach it "
        "could see your pods and act on them",
        hint="add --token T (or TPUPOD_DASHBOARD_TOKEN), or bind --host 127.0.0.1",
    )


TOKEN_HINT = "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe())'"


def check_token(token: str, source: str) -> None:
    """Refuse a token no browser or header can carry as given (``source`` names where it
    came from): a blank one was taken, and every action then failed 401."""
    if not token.strip():
        raise UsageError(f"{source} is blank", hint=TOKEN_HINT)
    if not token.isascii():
        raise UsageError(f"{source} has a character outside ASCII", hint=TOKEN_HINT)
    if any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError(f"{source} has a space or a control character", hint=TOKEN_HINT)


def allowed_hosts(host: str, names: Iterable[str]) -> frozenset[str]:
    """The names a request's Host header may carry (its port aside)."""
    served = {host.strip("[]"), *names}
    if is_loopback(host):
        served.update(LOOPBACK_NAMES)
    return frozenset(name.lower() for name in served)


def host_name(header: str) -> str:
    """``Host: name:port`` -> name (``[::1]:8750`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


def _refuse(status: int, detail: str) -> Response:
    return JSONResponse({"detail": detail}, status_code=status)


def action_refusal(request: Request, token: str | None) -> Response | None:
    """Why a POST may not act (None: it may): no token configured, a wrong or missing
    bearer token, or an Origin other than this page's own."""
    if not token:
        return _refuse(403, "read-only: start the dashboard with --token to allow actions")
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not secrets.compare_digest(given.encode(), token.encode()):
        return _refuse(401, "a bearer token is required for actions")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        return _refuse(403, f"cross-origin request from {origin} refused")
    if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
        return _refuse(403, "cross-site request refused")
    return None


Handler = Callable[[Request], Awaitable[Response]]


def guard_middleware(
    hosts: frozenset[str], token: str | None
) -> Callable[[Request, Handler], Awaitable[Response]]:
    """Starlette HTTP middleware: the Host check for every request, the action rule for POSTs."""

    async def guard(request: Request, call_next: Handler) -> Response:
        if host_name(request.headers.get("host", "")) not in hosts:
            return _refuse(400, "unknown Host header (start with --allow-host NAME to serve it)")
        if request.method not in ("GET", "HEAD"):
            refusal = action_refusal(request, token)
            if refusal is not None:
                return refusal
        return await call_next(request)

    return guard
