"""Credentials in URLs: hidden everywhere but the client call (`trainer.redact`)."""

from __future__ import annotations

import pytest

from spotrun.trainer.redact import redact, redact_tree
from spotrun.trainer.spec.job import JobSpec

CASES = [  # (text, as shown)
    ("postgresql://u:s3cret@db.example/h", "postgresql://u:***@db.example/h"),
    ("http://spot:s3cret@127.0.0.1:5000", "http://spot:***@127.0.0.1:5000"),
    ("https://u:p@ss@mlflow.example/x", "https://u:***@mlflow.example/x"),  # a raw "@" in the password
    ("https://:tok@h/", "https://:***@h/"),
    ("postgresql://u@db.example/h", "postgresql://u@db.example/h"),  # a user name alone stays
    (
        "postgresql://db/h?password=s3cret&sslmode=verify-full",
        "postgresql://db/h?password=***&sslmode=verify-full",
    ),
    (
        "https://b.s3.amazonaws.com/k?X-Amz-Signature=abc&X-Amz-Credential=AK",
        "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***",
    ),
    (
        "could not reach 'http://a:b@h:1/api' (refused); again",
        "could not reach 'http://a:***@h:1/api' (refused); again",
    ),
    ("two: s3://x/y and http://a:b@h http://c:d@i/", "two: s3://x/y and http://a:***@h http://c:***@i/"),
    ("no url here: a:b@c", "no url here: a:b@c"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("", ""),
]


@pytest.mark.parametrize(("text", "shown"), CASES)
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_the_spec_as_stored_has_no_credentials_and_the_spec_itself_keeps_them() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "j",
            "recipe": "digits",
            "total_steps": 10,
            "storage": "/tmp/x",
            "tracking": {"uri": "http://spot:s3cret@127.0.0.1:5000"},
            "s3": {"endpoint_url": "https://k:s3cret@minio.example"},
        }
    )
    public = spec.public_dump()
    assert "s3cret" not in repr(public)
    assert public["tracking"]["uri"] == "http://spot:***@127.0.0.1:5000"
    assert spec.tracking.uri == "http://spot:s3cret@127.0.0.1:5000"  # the client call gets it as written
    assert redact_tree({"a": ["http://u:p@h", 1, None]}) == {"a": ["http://u:***@h", 1, None]}
