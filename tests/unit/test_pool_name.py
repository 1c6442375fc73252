"""`provider.pool` names a socket under $SPOTRUN_HOME/pools and may come from a deployment run's
parameters: only a short plain name passes, refused in one line that says what to use."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spotrun.tasks.providers.local.config import LocalProviderConfig, pool_name_refusal


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("a", True),
        ("team-1", True),
        ("0day", True),
        ("x" * 40, True),
        ("x" * 41, False),  # a socket path has room for about 100 bytes
        ("", False),
        ("-lead", False),
        ("Upper", False),
        ("under_score", False),
        ("dot.ted", False),
        ("../../tmp/x", False),
        ("/abs", False),
        ("name\n", False),  # fullmatch: `$` would let a trailing newline through
        ("na me", False),
        ("nul\x00", False),
    ],
)
def test_only_a_short_plain_name_is_a_pool(name: str, plain: bool) -> None:
    assert (pool_name_refusal(name) is None) is plain


def test_a_refusal_is_one_line_that_names_the_fix() -> None:
    with pytest.raises(ValidationError) as e:
        LocalProviderConfig(pool="../etc")
    (error,) = e.value.errors()
    assert error["msg"] == (
        "Value error, pool '../etc' is not a plain name: use 1-40 of a-z, 0-9 and '-', starting with a "
        "letter or a digit"
    )


def test_a_pool_needs_the_fork_server() -> None:
    with pytest.raises(ValidationError, match="set fork_server: true, or leave pool out"):
        LocalProviderConfig(pool="team", fork_server=False)
    assert LocalProviderConfig(pool="team").pool_idle_s == 600
