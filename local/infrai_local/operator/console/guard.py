"""Who may read the console and who may act through it.

A token is made at each start and printed once, in the URL the operator opens (as Jupyter
does). The first request that carries it gets it back as a cookie (HttpOnly, SameSite=Strict)
and is sent on without it, so it leaves the address bar. Every page needs that cookie.

Every request must name the console in its ``Host`` header as the printed URL does (on loopback:
127.0.0.1, localhost or [::1]; off loopback: the ``--hostname`` the operator gave), so a page on
another site cannot reach the console through a name it re-points at the console's address.
An action is a POST, and is refused (403, nothing done) unless the console was started with
``--allow-actions``, the form carries the token, and the browser does not say the request came
from another site: ``Origin``, when sent, must be the console's own, and ``Sec-Fetch-Site``,
when sent, must be ``same-origin``. Each refusal says which check failed and what it met.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass

TOKEN_FIELD = "csrf_token"  # noqa: S105 - the form field's name, not a secret
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*", re.IGNORECASE)
# How much of a header a refusal quotes back.
_SHOWN = 120


def new_token() -> str:
    """A fresh secret for one start of the console."""
    return secrets.token_urlsafe(32)


def same_token(given: str | None, token: str) -> bool:
    """Whether ``given`` is the token, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    parsed = _address(address)
    return parsed is not None and parsed.is_loopback


def is_wildcard(address: str) -> bool:
    """Whether listening on ``address`` means every address of the machine."""
    parsed = _address(address)
    return address == "" or (parsed is not None and parsed.is_unspecified)


def bracketed(host: str) -> str:
    """``host`` as a URL names it (an IPv6 address in brackets)."""
    parsed = _address(host)
    return f"[{parsed}]" if isinstance(parsed, ipaddress.IPv6Address) else host


def hostname_refusal(name: str) -> str:
    """Why ``name`` cannot be the console's ``--hostname``, or ""."""
    parsed = _address(name)
    if parsed is not None:
        return "" if not parsed.is_unspecified else f"{name} is not an address one can open"
    if _DNS_NAME.fullmatch(name):
        return ""
    return (
        f"{name!r} is not a host name or an IP address (give the name alone: no scheme, "
        "port or path)"
    )


def _shown(value: str) -> str:
    return value if len(value) <= _SHOWN else value[:_SHOWN] + "..."


@dataclass(frozen=True, slots=True)
class Guard:
    """The checks of one running console: its token, where it listens, the name it answers to
    off loopback (``hostname``), whether it acts."""

    token: str
    port: int
    bind: str = "127.0.0.1"
    allow_actions: bool = False
    hostname: str = ""

    @property
    def cookie_name(self) -> str:
        # Cookies are not kept apart by port: two consoles must not overwrite each other's.
        return f"infrai_console_{self.port}"

    @property
    def url_host(self) -> str:
        """The host of the URL the console prints: the one that connects to where it listens."""
        if self.hostname:
            return bracketed(self.hostname)
        if self.bind == "localhost":
            return "127.0.0.1"
        return bracketed(self.bind)

    @property
    def own_origin(self) -> str:
        return f"http://{self.url_host}:{self.port}"

    def hosts(self) -> frozenset[str]:
        """The ``Host`` headers it answers to: the printed URL's, and loopback's where it
        listens on loopback."""
        names = {self.url_host}
        if is_loopback(self.bind) or is_wildcard(self.bind):
            names.update(_LOOPBACK_NAMES)
        hosts = {f"{name}:{self.port}".lower() for name in names}
        if self.port == 80:  # a browser leaves the default port out
            hosts.update(name.lower() for name in names)
        return frozenset(hosts)

    def origins(self) -> frozenset[str]:
        return frozenset(f"http://{host}" for host in self.hosts())

    def host_refusal(self, host: str | None) -> str:
        """Why a request with this ``Host`` header is refused, or ""."""
        if host is not None and host.lower() in self.hosts():
            return ""
        if is_loopback(self.bind):
            allowed = f"a loopback address (127.0.0.1, localhost or [::1]) on port {self.port}"
        else:
            allowed = f"the name it was started with (--hostname): {self.own_origin}"
            if is_wildcard(self.bind):
                allowed += ", or a loopback address"
        met = "no Host" if host is None else f"the Host {_shown(host)!r}"
        return f"this console answers only to {allowed}; this request named {met}"

    def read_refusal(self, cookie: str | None, query_token: str | None) -> str:
        """Why a page may not be shown, or ""."""
        if same_token(cookie, self.token) or same_token(query_token, self.token):
            return ""
        return (
            "this page needs the console's token: open the URL `infrai-jobs console` printed "
            "when it started (each start makes a new one)"
        )

    def action_refusal(
        self, form_token: str | None, *, origin: str | None, fetch_site: str | None
    ) -> str:
        """Why a POST may not act, or "" when it may (``origin`` and ``fetch_site``: the
        request's ``Origin`` and ``Sec-Fetch-Site`` headers, None when not sent)."""
        if not self.allow_actions:
            return (
                "the console is read-only: start it with `infrai-jobs console --allow-actions` "
                "to act (or type the command it shows)"
            )
        if not same_token(form_token, self.token):
            return "the form did not carry this console's token; reload the page and try again"
        if origin is not None and origin.lower() not in self.origins():
            return (
                f"the request came from another site: its Origin is {_shown(origin)!r}, and "
                f"this console's is {self.own_origin} (open the console at that address)"
            )
        if fetch_site is not None and fetch_site != "same-origin":
            return (
                f"the request came from another site: the browser marked it "
                f"{_shown(fetch_site)!r} (Sec-Fetch-Site), not same-origin"
            )
        return ""
