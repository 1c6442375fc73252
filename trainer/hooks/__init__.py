"""Hooks: a job's own commands at the ends of an attempt (`hooks:` in the job file, trainer/spec/hooks.py).

- `runner`: run one command with a timeout (its whole process group killed at it), keeping its output's
  tail, exit code and duration; shared with the controller's `on_attempt_end` (tasks/control/hooks.py).
- `worker`: which hook an attempt's ending fires on the worker, the variables it gets, its status record.
"""
