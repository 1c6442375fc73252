"""Not a test: one deliberate type error that `make typecheck` requires mypy to report. Were imports of
`spotrun.trainer` unresolved, mypy would type them Any and this line would pass unnoticed."""

from spotrun.trainer.exitcodes import ExitCode

wrong: int = ExitCode.COMPLETED.name
