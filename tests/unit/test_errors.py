"""The logging fields on errors (trainer/errors.py) and how the process edge (trainer/__main__.py) reads
them: an error already said where it was found, or rank 0's verdict raised on every rank, is not said
again; both survive the pickling that a broadcast between ranks does."""

from __future__ import annotations

import logging
import pickle

import pytest

from spotrun.trainer.__main__ import _classify
from spotrun.trainer.errors import CheckpointError, ConfigError, LeaseLost, SpotrunError, is_echo, mark_echo
from spotrun.trainer.exitcodes import ExitCode


def caused(e: Exception, cause: BaseException) -> Exception:
    """`e` as `raise e from cause` leaves it."""
    e.__cause__ = cause
    return e


def echoed(e: BaseException) -> BaseException:
    """`e` as a rank other than 0 raises rank 0's verdict."""
    mark_echo(e, True)
    return e


def test_mark_sets_only_what_it_names_and_survives_pickling() -> None:
    plain = SpotrunError("x")
    assert (plain.logged, plain.echo) == (False, False)
    lost = LeaseLost("taken", taken_by="w-2").mark(logged=True)
    assert (lost.logged, lost.echo) == (True, False)
    again = pickle.loads(pickle.dumps(lost.mark(echo=True)))
    assert (type(again), str(again), again.taken_by) == (LeaseLost, "taken", "w-2")
    assert (again.logged, again.echo) == (True, True)


@pytest.mark.parametrize("error", [ConfigError("bad"), OSError("disk")])
def test_echo_on_any_error_survives_pickling(error: BaseException) -> None:
    assert not is_echo(error)
    mark_echo(error, False)  # rank 0 marks its own copy False: it says it
    assert not is_echo(error)
    assert is_echo(pickle.loads(pickle.dumps(echoed(error))))


ROWS = [
    (ConfigError("bad field"), ExitCode.CONFIG_ERROR, [(logging.ERROR, "bad field")]),
    (LeaseLost("taken", taken_by="w-2"), ExitCode.LEASE_LOST, [(logging.ERROR, "taken")]),
    (LeaseLost("taken", taken_by="w-2").mark(logged=True), ExitCode.LEASE_LOST, []),
    (LeaseLost("ran out").mark(logged=True), ExitCode.CRASHED, []),
    (
        caused(CheckpointError("save"), LeaseLost("t", taken_by="w").mark(logged=True)),
        ExitCode.LEASE_LOST,
        [],
    ),
    (
        LeaseLost("taken", taken_by="w-2").mark(echo=True, logged=False),
        ExitCode.LEASE_LOST,
        [(logging.INFO, "stopping with rank 0 (LeaseLost; rank 0 logged why)")],
    ),
    (
        echoed(ConfigError("bad")),
        ExitCode.CONFIG_ERROR,
        [(logging.INFO, "stopping with rank 0 (ConfigError; rank 0 logged why)")],
    ),
    (
        echoed(OSError("disk")),
        ExitCode.CRASHED,
        [(logging.INFO, "stopping with rank 0 (OSError; rank 0 logged why)")],
    ),
]


@pytest.mark.parametrize(("error", "code", "lines"), ROWS)
def test_the_exit_says_an_error_once(
    error: Exception, code: ExitCode, lines: list[tuple[int, str]], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="spotrun.trainer"):
        assert _classify(error) is code
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == lines
