"""Tamper evidence for manifests: an HMAC-SHA256 with a key only the job's machines hold.

A file digest detects damage; it cannot detect tampering, since whoever can rewrite a file in the
bucket can rewrite the manifest's digest too. With `SPOTRUN_MANIFEST_KEY` set (on the trainers and on
whatever validates: the controller, `spotrun checkpoints`), every manifest carries
`signature = HMAC-SHA256(key, the manifest without it, canonical JSON)`, and a manifest that is
unsigned or signed otherwise is rejected like a damaged one. Without the key nothing is signed and
signatures are not checked. On a team's Prefect deployment, keep the key in a Prefect Secret block
and put it in the work pool's environment (docs/operations.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "SPOTRUN_MANIFEST_KEY"


def manifest_key() -> bytes | None:
    """The signing key from the environment (read where it is used: trainers and validators alike)."""
    key = os.environ.get(KEY_ENV, "")
    return key.encode() if key else None


def signature(body: dict[str, Any], key: bytes) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def check(body: dict[str, Any], sig: str | None, key: bytes | None) -> str | None:
    """None when the manifest is acceptable under `key`, else why not."""
    if key is None:
        return None
    if not sig:
        return f"manifest is not signed ({KEY_ENV} is set here)"
    if not hmac.compare_digest(sig, signature(body, key)):
        return "manifest signature does not match (tampered with, or signed with another key)"
    return None
