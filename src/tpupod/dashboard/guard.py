"""Who may talk to the dashboard: the bind rule, the Host header check, the token.

Ray's dashboard listened on 0.0.0.0 without auth and its job API ran anyone's code
(ShadowRay); a page that answers any Host header can be reached from a web page through DNS
rebinding. So: loopback by default, any other bind only with a token; a request naming a
host we do not serve gets 400. On loopback, reads are open (whoever can reach them is on
this machine) and an action (a POST) needs the token; bound beyond loopback, every request
does (a job's command and a run's logs are read with it). The token comes as
``Authorization: Bearer T``, or as the session cookie a page gets for it
(``POST /api/session``: a browser's event streams cannot send a header). An action
authorised by the cookie must come from the page's own origin.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tpupod.errors import UsageError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
PUBLIC = ("/static/", "/favicon.ico")  # what the sign-in page itself loads
TOKEN_HINT = "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe())'"
REQUIRED = "a token is required: open the page with 'tpupod dashboard --open', or send it"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def check_bind(host: str, token: str | None) -> None:
    """Refuse a bind beyond this machine without a token (before anything listens)."""
    if token or is_loopback(host):
        return
    raise UsageError(
        f"the dashboard would listen on {host} without a token: anyone who can reach it "
        "could see your pods and act on them",
        hint="add --token T (or TPUPOD_DASHBOARD_TOKEN), or bind --host 127.0.0.1",
    )


def check_token(token: str, source: str) -> None:
    """Refuse a token no browser or header can carry as given (``source`` names where it
    came from): a blank one was taken, and every action then failed 401."""
    if not token.strip():
        raise UsageError(f"{source} is blank", hint=TOKEN_HINT)
    if not token.isascii():
        raise UsageError(f"{source} has a character outside ASCII", hint=TOKEN_HINT)
    if any(c.isspace() or not c.isprintable() for c in token):
        raise UsageError(f"{source} has a space or a control character", hint=TOKEN_HINT)


class HostCheck:
    """The names a request's Host header may carry (its port aside): the bound address and
    ``--allow-host`` names; on loopback, loopback's names; bound to every address (0.0.0.0,
    ::), also this machine's own names and any address it has."""

    def __init__(self, host: str, names: Iterable[str]) -> None:
        self.wildcard = is_wildcard(host)
        served = {host.strip("[]"), *names}
        if is_loopback(host) or self.wildcard:
            served.update(LOOPBACK_NAMES)
        if self.wildcard:
            served.update((socket.gethostname(), socket.getfqdn()))
        self.names = frozenset(name.lower() for name in served)

    def __call__(self, name: str) -> bool:
        return name in self.names or (self.wildcard and _own_address(name))


@functools.lru_cache(maxsize=64)
def _own_address(name: str) -> bool:
    """Whether ``name`` is an IP address of this machine: the kernel lets a socket bind to
    no other (names are not resolved: a rebinding attacker's name resolves to us too)."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((name, 0))
        except OSError:
            return False
    return True


def host_name(header: str) -> str:
    """``Host: name:port`` -> name (``[::1]:8750`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


@dataclass(frozen=True)
class Access:
    """The dashboard's rules for one bind: ``port`` names its cookie (cookies are shared by
    every port of a host)."""

    hosts: HostCheck
    token: str | None
    exposed: bool  # bound beyond loopback: reads need the token too
    port: int

    @classmethod
    def of(cls, host: str, names: Iterable[str], token: str | None, port: int) -> Access:
        return cls(HostCheck(host, names), token, not is_loopback(host), port)

    @property
    def cookie(self) -> str:
        return f"tpupod-dashboard-{self.port}"

    def session(self) -> str:
        """The cookie's value: derived from the token, so the cookie is not the token."""
        assert self.token is not None
        return hmac.new(
            self.token.encode(), b"tpupod dashboard session", hashlib.sha256
        ).hexdigest()

    def refusal(self, request: Request) -> tuple[int, str] | None:
        """Why ``request`` may not be answered, as (status, detail); None: it may."""
        if not self.hosts(host_name(request.headers.get("host", ""))):
            return 400, "unknown Host header (start with --allow-host NAME to serve it)"
        if request.method not in ("GET", "HEAD"):
            return self._action_refusal(request)
        if self.exposed and not request.url.path.startswith(PUBLIC):
            why = self._credential(request)
            return None if why is None else (401, why)
        return None

    def _action_refusal(self, request: Request) -> tuple[int, str] | None:
        if not self.token:
            return 403, "read-only: start the dashboard with --token to allow actions"
        why = self._credential(request)
        if why is not None:
            return 401, why
        origin = request.headers.get("origin")
        own = f"{request.url.scheme}://{request.headers.get('host', '')}"
        if origin is not None and origin != own:
            return 403, f"cross-origin request from {origin} refused"
        if origin is None and "authorization" not in request.headers:
            return 403, "an action by cookie must come from the dashboard's own page"
        if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            return 403, "cross-site request refused"
        return None

    def _credential(self, request: Request) -> str | None:
        """None when the request carries the token (header) or its session (cookie); else
        why not."""
        if not self.token:
            return REQUIRED
        header = request.headers.get("authorization")
        if header is not None:
            given = header.removeprefix("Bearer ").strip()
            return (
                None if hmac.compare_digest(given.encode(), self.token.encode()) else "wrong token"
            )
        cookie = request.cookies.get(self.cookie)
        if cookie is not None:  # a cookie of a dashboard started with another token: wrong
            return None if hmac.compare_digest(cookie, self.session()) else "wrong token"
        return REQUIRED


class Guard:
    """ASGI middleware: ``access``'s rules for every HTTP request; a refused page (not
    ``/api/``, not ``/metrics``) gets the sign-in page ``sign_in(why)`` instead of JSON."""

    def __init__(self, app: ASGIApp, access: Access, sign_in: Callable[[str], str]) -> None:
        self.app = app
        self.access = access
        self.sign_in = sign_in

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refused = self.access.refusal(request)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, detail = refused
        response: Response = JSONResponse({"detail": detail}, status_code=status)
        path = request.url.path
        if status == 401 and request.method == "GET" and not path.startswith(("/api/", "/metrics")):
            response = HTMLResponse(self.sign_in(detail), status_code=status)
        if status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def set_session(response: Response, access: Access) -> None:
    """The session cookie on ``response``: the page's script never reads it (HttpOnly), and
    no other site's request carries it (SameSite=Strict)."""
    response.set_cookie(access.cookie, access.session(), httponly=True, samesite="strict", path="/")
