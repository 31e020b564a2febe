"""Who may read the console and who may act through it.

A token is made at each start and printed once, in the URL the operator opens (as Jupyter
does). The first request that carries it gets it back as a cookie (HttpOnly, SameSite=Strict)
and is sent on without it, so it leaves the address bar. Every page needs that cookie.

An action is a POST, and is refused (403, nothing done) unless the console was started with
``--allow-actions``, the form carries the token, and the browser does not say the request came
from another site: ``Origin``, when sent, must be the console's own, and ``Sec-Fetch-Site``,
when sent, must be ``same-origin``. On loopback the ``Host`` header must name loopback too, so
a page on another site cannot reach the console through a name it re-points at 127.0.0.1.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass

TOKEN_FIELD = "csrf_token"  # noqa: S105 - the form field's name, not a secret
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def new_token() -> str:
    """A fresh secret for one start of the console."""
    return secrets.token_urlsafe(32)


def same_token(given: str | None, token: str) -> bool:
    """Whether ``given`` is the token, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Guard:
    """The checks of one running console: its token, where it listens, whether it acts."""

    token: str
    port: int
    bind: str = "127.0.0.1"
    allow_actions: bool = False

    @property
    def cookie_name(self) -> str:
        # Cookies are not kept apart by port: two consoles must not overwrite each other's.
        return f"infrai_console_{self.port}"

    def origins(self) -> frozenset[str]:
        names = _LOOPBACK_NAMES if is_loopback(self.bind) else (self.bind,)
        return frozenset(f"http://{name}:{self.port}" for name in names)

    def host_refusal(self, host: str | None) -> str:
        """Why a request with this ``Host`` header is refused, or ""."""
        if not is_loopback(self.bind):
            return ""
        if host in {f"{name}:{self.port}" for name in _LOOPBACK_NAMES}:
            return ""
        return "this console answers only to a loopback address (127.0.0.1 or localhost)"

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
        if origin is not None and origin not in self.origins():
            return "the request came from another site"
        if fetch_site is not None and fetch_site != "same-origin":
            return "the request came from another site"
        return ""
