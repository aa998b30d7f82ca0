"""Credentials for the servers cancelwatch talks to: taken at the command line's edge, sent only to
the server they belong to, and never stored (not in the run, its events, its gaps or its messages).

An engine started with `--api-key` (or VLLM_API_KEY) guards /v1/*: the key is read from an
environment variable, never from the command line, where the shell history and `ps` would show it.
User and password in a URL (`http://user:pw@host:8000`) become that server's Basic credentials and
the URL is kept without them.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

# looked up in this order when no --api-key-env is given
DEFAULT_KEY_VARS = ("VLLM_API_KEY", "OPENAI_API_KEY")


class CredentialError(ValueError):
    """A named credential that is not there; the message is one line that names the fix."""


def split_userinfo(url: str) -> tuple[str, str | None]:
    """(the URL without user:password@, the Authorization header value those credentials make, or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        if "@" in url.split("://", 1)[-1]:
            # an "@" after the host: a password holding "/", "?" or "#" unencoded cut the URL short, so
            # what looks like a path may hold it. Refuse rather than send or store it
            raise CredentialError("a URL with user:password must percent-encode '/', '?', '#' and '@' in them "
                                  "(e.g. %2F for /): the URL given cannot be split safely")
        return url, None
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port is not None else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return clean, f"Basic {token}"


def strip_userinfo(url: str) -> str:
    """The URL without credentials, for a message or the run; never raises (an unsplittable URL loses
    everything from its scheme to its last '@')."""
    try:
        return split_userinfo(url)[0]
    except CredentialError:
        i, j = url.find("://"), url.rfind("@")
        return url[:i + 3] + url[j + 1:] if i >= 0 else url[j + 1:]


def api_key(env_var: str | None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(the key, the variable it came from). A variable named with --api-key-env must be set; without
    one, the first of DEFAULT_KEY_VARS that is set, or no key."""
    environ = os.environ if environ is None else environ
    if env_var:
        value = environ.get(env_var)
        if not value:
            raise CredentialError(f"--api-key-env {env_var}: the environment variable {env_var} is not set: "
                                  f"export {env_var}=<key> or name the variable that holds the key")
        return value, env_var
    for var in DEFAULT_KEY_VARS:
        if environ.get(var):
            return environ[var], var
    return None, None


def auth_headers(key: str | None, basic: str | None) -> dict[str, str]:
    """The Authorization header for one server: its API key (Bearer) wins over URL credentials."""
    if key:
        return {"Authorization": f"Bearer {key}"}
    if basic:
        return {"Authorization": basic}
    return {}
