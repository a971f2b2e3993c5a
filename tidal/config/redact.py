"""URIs fit for logs, MLflow params and artifacts: credentials in them become ***. Used by the
broker's checks (a bad broker.redis.url is shown redacted) and by the run's flatten/redacted_config."""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

REDACTED = "***"
# query parameters that carry a credential: tokens, passwords, keys, signatures (SAS `sig`), auth
SECRET_PARAM = re.compile(r"token|pass|pwd|secret|key|auth|credential|signature|^sig$|session", re.IGNORECASE)


def redact_uri(uri: str) -> str:
    """`uri` fit for logs, params and artifacts: a password (or a user part without one, which may be
    a token) becomes ***, and so does every query value whose name says it is a credential. The rest
    is kept character for character (sqlite:////abs/path stays as it is)."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # not a URI at all: nothing of it is shown
        return REDACTED
    out = uri
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if has_password else f"{REDACTED}@{host}"
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        fields = [_redact_field(field) for field in parts.query.split("&")]
        out = out.replace(f"?{parts.query}", "?" + "&".join(fields), 1)
    return out


def _redact_field(field: str) -> str:
    name, has_value, _ = field.partition("=")
    return f"{name}={REDACTED}" if has_value and SECRET_PARAM.search(unquote(name)) else field
