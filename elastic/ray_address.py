"""A Ray address as a user gives it (``ray_address``, ``$RAY_ADDRESS``): its host and port,
and whether anything listens there, said with the fix when it is no Ray address (the
dashboard's http address, a missing port, an IPv6 address without brackets). Pure but for
one socket connection; no Ray."""

from __future__ import annotations

import os
import socket

from .errors import ClusterError

__all__ = ["host_port", "check_reachable", "token_source", "token", "auth_error"]


def host_port(addr: str) -> tuple[str, int]:
    """The host and port of a Ray address: ``host:port``, ``[ipv6]:port`` or
    ``ray://host:port``. Raises ``ValueError(problem, fix)`` saying what is wrong (was: "Name
    or service not known" for an http:// address, "invalid literal for int()" for a missing
    port or a bracketed IPv6 address)."""
    if addr.lower().startswith(("http://", "https://")):
        raise ValueError(
            f"{addr} is an http(s) address: the Ray dashboard's or its Jobs API's, which a "
            "driver cannot attach to",
            "use the cluster's GCS address host:port (port 6379 unless its head was started "
            f"with another --port), or submit the job with `ray job submit --address {addr} "
            "--working-dir . -- elastic run job.yaml` (docs/ray-jobs.md)")
    client = addr.lower().startswith("ray://")
    rest = addr[len("ray://"):] if client else addr
    usual = "10001 (the Ray Client server's)" if client else "6379 (the GCS's)"
    if "://" in rest:
        raise ValueError(f"{addr} is not a Ray address",
                         "give host:port (the GCS's, usually port 6379) or ray://host:10001")
    if rest.startswith("["):  # [ipv6]:port
        host, closed, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else tail
        if not closed:
            raise ValueError(f"{addr} opens [ but does not close it", "write [ipv6]:port")
    else:
        host, colon, port = rest.rpartition(":")
        if not colon:
            host, port = rest, ""
        elif ":" in host:
            raise ValueError(f"{addr} is an IPv6 address without brackets",
                             "write [ipv6]:port, e.g. [::1]:6379")
    if not port:
        raise ValueError(f"{addr} has no port",
                         f"add it, usually {usual}: {addr.rstrip(':')}:{usual.split()[0]}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{addr}: {port!r} is not a port number",
                         f"give host:port, usually port {usual}")
    return host or "127.0.0.1", int(port)


def check_reachable(addr: str) -> None:
    """Fail fast, with the fix, when ``addr`` is no Ray address (``host_port``) or nothing
    listens there (``ray.init`` would wait)."""
    try:
        host, port = host_port(addr)
    except ValueError as e:
        problem, fix = e.args
        raise ClusterError(f"ray_address / RAY_ADDRESS: {problem}. Fix: {fix}.") from None
    try:
        with socket.create_connection((host, port), timeout=3):
            pass
    except OSError as e:
        raise ClusterError(
            f"cannot reach the Ray cluster at {addr} ({e}). Fix: start one with "
            "`ray start --head`, correct ray_address / RAY_ADDRESS, or unset it to run locally."
        ) from None


# ---------------------------------------------------------------------------- its token


def token_source() -> str | None:
    """Where Ray would read this driver's token from (as its loader looks), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:  # Ray reads only this file then: a missing one is no token
        return f"RAY_AUTH_TOKEN_PATH ({path})" if os.path.isfile(path) else None
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        # written by `ray get-auth-token --generate` or by a local ray.init(); `ray start
        # --head` turns token authentication on by itself when this file exists
        return "~/.ray/auth_token"
    return None


def token() -> str | None:
    """The token itself, from where ``token_source`` says."""
    source = token_source()
    if source is None or source == "RAY_AUTH_TOKEN":
        return os.environ.get("RAY_AUTH_TOKEN")
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    with open(path) as f:
        return f.read().strip()


def auth_error(addr: str, sent: bool = False) -> ClusterError:
    """The refusal of a cluster that requires a token (``sent``: this driver sent one, as
    attaching to the machine's own head does without RAY_AUTH_MODE)."""
    source = token_source()
    if source and (sent or os.environ.get("RAY_AUTH_MODE", "").lower() == "token"):
        why = f"it rejected this driver's token (from {source})"
        fix = "set RAY_AUTH_TOKEN to the cluster's token (the one its head was started with)"
    elif source:
        why = "it requires token authentication, which this driver has not turned on"
        fix = f"export RAY_AUTH_MODE=token (this driver then sends the token in {source})"
    else:
        why = "it requires an authentication token"
        fix = ("export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (the one "
               "its head was started with)")
    return ClusterError(f"the Ray cluster at {addr} refused this driver: {why}. Fix: {fix}, "
                        "then run the command again.")
