"""Which of a job's args shape its state, whichever way in it uses: a recipe declares them in code
(`@recipe(shape_args=...)`), an entry point in the job file (`shape_args:`). Apart from the spec because a
recipe's declaration is read by importing the recipe (torch, user code), and the spec imports neither."""

from __future__ import annotations

from spotrun.trainer.spec.job import JobSpec


def spec_shape_args(spec: JobSpec) -> frozenset[str] | None:
    """The args that shape the job's state (model and optimizer structure); None: every arg does. For a
    recipe job, what the recipe declares (imports it); for an entry point job, its `shape_args`."""
    if spec.recipe is not None:
        from spotrun.trainer import recipes  # torch and the recipe's module: only a recipe job pays for them

        return recipes.shape_args(spec.recipe)
    return frozenset(spec.shape_args) if spec.shape_args is not None else None
