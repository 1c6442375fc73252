"""The job spec: the typed model of a job file that the trainer, the flow and the Prefect UI form share.

A change here is a new job field. Modules:
- `job`: `JobSpec` and its option groups, `load_spec` / `parse_spec`, the shape hash and `spec_changes`.
- `runs`: the fields of jobs that run again and again (run key, warm start, promotion, retention).
- `templating`: the one templating function for every `{name}` in a job.
- `entrypoints`: a job's own loop, `entrypoint: package.module:function`.
- `hooks`: a job's own commands at the ends of an attempt (`hooks:`).
- `messages`: pydantic's errors as the one line a user reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.spec.entrypoints import call_main as call_main
    from spotrun.trainer.spec.entrypoints import resolve_entrypoint as resolve_entrypoint
    from spotrun.trainer.spec.entrypoints import split_entrypoint as split_entrypoint
    from spotrun.trainer.spec.entrypoints import takes_args as takes_args
    from spotrun.trainer.spec.hooks import HookOptions as HookOptions
    from spotrun.trainer.spec.job import Change as Change
    from spotrun.trainer.spec.job import CheckpointPolicy as CheckpointPolicy
    from spotrun.trainer.spec.job import DistributedOptions as DistributedOptions
    from spotrun.trainer.spec.job import EnvOptions as EnvOptions
    from spotrun.trainer.spec.job import JobSpec as JobSpec
    from spotrun.trainer.spec.job import PreemptionOptions as PreemptionOptions
    from spotrun.trainer.spec.job import describe_changes as describe_changes
    from spotrun.trainer.spec.job import load_spec as load_spec
    from spotrun.trainer.spec.job import never_passed as never_passed
    from spotrun.trainer.spec.job import parse_spec as parse_spec
    from spotrun.trainer.spec.job import spec_changes as spec_changes
    from spotrun.trainer.spec.runs import BEST as BEST
    from spotrun.trainer.spec.runs import LATEST_COMPLETED as LATEST_COMPLETED
    from spotrun.trainer.spec.runs import Promotion as Promotion
    from spotrun.trainer.spec.runs import RunSource as RunSource
    from spotrun.trainer.spec.runs import key_problem as key_problem
    from spotrun.trainer.spec.templating import fill as fill
    from spotrun.trainer.spec.templating import fill_tree as fill_tree
    from spotrun.trainer.spec.templating import pieces as pieces

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "BEST": "runs",
    "Change": "job",
    "CheckpointPolicy": "job",
    "DistributedOptions": "job",
    "EnvOptions": "job",
    "HookOptions": "hooks",
    "JobSpec": "job",
    "LATEST_COMPLETED": "runs",
    "PreemptionOptions": "job",
    "Promotion": "runs",
    "RunSource": "runs",
    "call_main": "entrypoints",
    "describe_changes": "job",
    "fill": "templating",
    "fill_tree": "templating",
    "key_problem": "runs",
    "load_spec": "job",
    "never_passed": "job",
    "parse_spec": "job",
    "pieces": "templating",
    "resolve_entrypoint": "entrypoints",
    "spec_changes": "job",
    "split_entrypoint": "entrypoints",
    "takes_args": "entrypoints",
}
__getattr__ = lazy_exports(__name__, _WHERE)
