"""An engine's command line as it may be kept: with every credential it carries redacted.

`cancelwatch engine up -- --api-key KEY` hands vLLM's own flags through unchanged: the engine needs the
key. What is written afterwards (the engine state file, the run's facts, and from them the protocol, the
report, the notebooks and every message) holds the redacted copy: a store, an export or a shared report
never carries the key.
"""

from __future__ import annotations

import json
import re

REDACTED = "<redacted>"

# the flags whose whole value is a secret: vLLM's own list (`_SENSITIVE_ARG_FIELDS` in
# vllm/entrypoints/serve/utils/api_utils.py: api_key, hf_token, watermark_config, whose `key` is a secret)
SECRET_FLAGS = frozenset({"api-key", "hf-token", "watermark-config"})
# and any flag whose name ends in one of these words (--auth-token, --ssl-keyfile-password, --client-secret);
# a word inside a name is another thing (--long-prefill-token-threshold, --max-num-batched-tokens)
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential"})
# a key of a JSON value, or a URL query parameter, that names a secret (accessToken, X-Amz-Signature, sig)
_SECRET_NAME = re.compile(r"(key|token|secret|passw(or)?d|credential|signature|^sig$|auth)", re.IGNORECASE)
# user:password@ right after a scheme, to the argument's last '@' before a space or quote: a password
# holding an unencoded '/' or '@' is cut whole rather than in part
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^\s\"']*)@")
_QUERY = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&#\s\"']+)=(?P<value>[^&#\s\"']*)")
_NUMBER = re.compile(r"-\d[\d.]*")  # a negative number is a value (`--api-key -12345`), not a flag


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg not in ("-", "--") and not _NUMBER.fullmatch(arg)


def _secret_flag(flag: str) -> bool:
    name = flag.lstrip("-").lower().replace("_", "-")
    return name in SECRET_FLAGS or name.split(".")[0] in SECRET_FLAGS or re.split(r"[-.]", name)[-1] in SECRET_WORDS


def _redact_json(value, found: set[str]):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if _SECRET_NAME.search(str(k)) and not isinstance(v, (dict, list)):
                found.add(str(v))
                out[k] = REDACTED
            else:
                out[k] = _redact_json(v, found)
        return out
    if isinstance(value, list):
        return [_redact_json(v, found) for v in value]
    if isinstance(value, str):
        return _redact_text(value, found)
    return value


def _redact_text(arg: str, found: set[str]) -> str:
    """URL credentials and secret query parameters cut from any text; a JSON object's secret keys too."""
    if arg.lstrip().startswith(("{", "[")):
        try:
            value = json.loads(arg)
        except ValueError:
            value = None
        if value is not None:
            redacted = _redact_json(value, found)
            return arg if redacted == value else json.dumps(redacted)  # untouched JSON keeps its spelling

    def userinfo(m: re.Match) -> str:
        found.add(m["info"])
        return f"{m['scheme']}{REDACTED}@"

    def query(m: re.Match) -> str:
        if not _SECRET_NAME.search(m["name"]):
            return m.group(0)
        found.add(m["value"])
        return f"{m['sep']}{m['name']}={REDACTED}"

    return _QUERY.sub(query, _USERINFO.sub(userinfo, arg))


def redact_command(argv: list[str]) -> tuple[list[str], set[str]]:
    """(the command line with every credential replaced by <redacted>, the secrets it held).

    The value of a secret flag is redacted whether given as `--flag=VALUE` or as the arguments after it up
    to the next flag (vLLM's --api-key takes several keys); URL credentials, secret query parameters and the
    secret keys of a JSON value are cut from every other argument. Argument for argument: the kept line
    still reads as the one that ran."""
    out: list[str] = []
    found: set[str] = set()
    in_secret = False
    for arg in map(str, argv):
        if _is_flag(arg):
            flag, eq, value = arg.partition("=")
            in_secret = _secret_flag(flag)
            if eq and in_secret:
                found.add(value)
                out.append(f"{flag}={REDACTED}")
                in_secret = False  # --flag=VALUE takes no further arguments
            elif eq:
                out.append(f"{flag}={_redact_text(value, found)}")
            else:
                out.append(arg)
        elif in_secret:
            found.add(arg)
            out.append(REDACTED)
        else:
            out.append(_redact_text(arg, found))
    return out, {s for s in found if s}


def scrub(text: str, secrets: set[str]) -> str:
    """`text` (a message, a log's tail) with every one of `secrets` replaced by <redacted>. Values of one to
    three characters are left: replacing every "4" of a message would garble it, and say nothing."""
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
