"""The one rule for a Redis/Valkey URL (the second layer's store), from REDIS_URL or a secret."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from infrai_jobs.errors import ConfigurationError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address: the hosts plain HTTP and plain Redis may reach."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_redis_url(name: str, url: str) -> None:
    """``rediss://`` (TLS, certificate and host name verified), ``redis://`` to loopback, or a
    ``unix://`` socket; a query parameter weakening the TLS check (``ssl_cert_reqs=none``, ...)
    is refused. The URL may hold a password: errors name ``name`` and the host only."""
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigurationError(f"{name} must start with redis://, rediss:// or unix://")
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        raise ConfigurationError(f"{name} is not a valid URL") from None
    if url.startswith("redis://") and not is_loopback_host(host):
        raise ConfigurationError(
            f"{name} uses redis:// (plain text) to {host or 'no host'}: use rediss:// for any "
            "host that is not loopback, so the password and the records travel encrypted"
        )
    for parameter, values in parse_qs(parts.query, keep_blank_values=True).items():
        keeps_check = _REDIS_TLS_WEAKENERS.get(parameter.lower())
        if keeps_check is not None and not all(map(keeps_check, values)):
            raise ConfigurationError(
                f"{name} sets {parameter}={values[0]}, which weakens the TLS check of the "
                f"server at {host or 'its socket'}: remove it (the certificate and the host "
                "name are always verified)"
            )


# The query parameters of a Redis URL (as redis-py reads them) that can turn a TLS check off,
# each with the values that keep it on.
_REDIS_FALSE_WORDS = frozenset({"", "0", "F", "FALSE", "N", "NO", "OFF"})
_REDIS_TLS_WEAKENERS: dict[str, Callable[[str], bool]] = {
    "ssl_cert_reqs": lambda value: value.strip().lower() == "required",
    "ssl_check_hostname": lambda value: value.strip().upper() not in _REDIS_FALSE_WORDS,
    "ssl_exclude_verify_flags": lambda value: False,
}


def redis_lacks_auth(url: str) -> bool:
    """Whether a Redis URL (one ``check_redis_url`` passed) to a host off loopback carries no
    password: the server then lets anyone who reaches it read and write the second layer's
    records."""
    parts = urlsplit(url)
    return not (
        url.startswith("unix://") or is_loopback_host(parts.hostname or "") or parts.password
    )
