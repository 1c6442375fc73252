"""The one redaction of credentials in URLs, for everything spotrun writes where others can read it.

A tracking URI, a database URL or an endpoint may carry `user:password@` (or `?password=...`). Only
the client call gets the URL as written; what spotrun copies anywhere else (the bucket's
COMPLETED.json and checkpoint spec, tracking.json, MLflow params and artifacts, logs, status lines,
error messages) goes through `redact` first. The user name stays: it says which account, not how to
be it.
"""

from __future__ import annotations

import re
from typing import Any

HIDDEN = "***"
# scheme://user:password@ -- greedy up to the last "@" before the path, so a password holding a raw "@"
# is hidden whole.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*):[^\s/]*@")
_SECRET_PARAMS = re.compile(
    r"(?P<head>[?&](?:password|passwd|pwd|token|access_token|secret|x-amz-signature|x-amz-credential"
    r"|x-amz-security-token)=)[^&#\s]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every URL's password (and secret query parameters) replaced by `***`."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\g<head>:{HIDDEN}@", text)
    return _SECRET_PARAMS.sub(rf"\g<head>{HIDDEN}", text)


def redact_tree(value: Any) -> Any:
    """A JSON-like value (a dumped spec) with every string redacted; a new value, the input unchanged."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_tree(v) for v in value]
    return value
