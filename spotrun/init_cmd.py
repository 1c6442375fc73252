"""`spotrun init`: a commented job file (and, for a loop or a recipe, a small module it runs) written into
the current directory, so one's own project starts from something that runs on the local spot simulator:
`spotrun init && spotrun run job.yaml --preempt-at 0.5:kill,0.5`.

Nothing is overwritten: a file that exists already is named in one line and nothing is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from spotrun.console import EXIT_OK, Subparsers
from spotrun.trainer.errors import ConfigError

_COMMON = """\
total_steps: 3000             # optimizer steps in all; a resumed attempt goes on from its checkpoint
batch_size: 32
seed: 7                       # the global RNGs are seeded with it before your code builds the model
threads: 1                    # torch's threads: results differ bitwise across thread counts
checkpoint: {every_steps: 250, keep: 3}
# storage: s3://bucket/prefix  # default: $SPOTRUN_HOME/checkpoints/NAME (a relative path is under it)
"""

LOOP_JOB = """\
# A job of your own loop (spotrun.session in train.py). Run it on the local spot simulator:
#   spotrun run job.yaml                              # uninterrupted
#   spotrun run job.yaml --preempt-at 0.5:kill,0.5    # reclaimed without notice after 0.5 s, then with one
name: NAME
entrypoint: train:main        # module:function, imported from this directory as Python would
args: {hidden: 64, lr: 0.003}  # your function gets them as main(args)
"""

LOOP = '''\
"""train.py: a training loop of one's own, resumable by spotrun (job.yaml names it as train:main)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import spotrun


def blobs(n: int, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 16 dimensions, made from their own generator: the same on every worker."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(4, (n,), generator=g)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 2
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y)


def main(args: dict) -> None:
    hidden = args.get("hidden", 64)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=args.get("lr", 3e-3))
    # restored from the newest valid checkpoint before the block starts; saved in the background
    with spotrun.session(model=model, optimizer=opt) as s:
        for x, y in s.batches(blobs(4096, seed=1)):  # a seed-pure order that resumes mid-epoch
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(s.model(x), y)
            loss.backward()
            opt.step()
            s.step_done(loss.item())  # the step boundary: metrics, checkpoints, notices
'''

RECIPE_JOB = """\
# A job of a recipe (recipe.py builds the parts; spotrun owns the loop). Run it on the local spot simulator:
#   spotrun run job.yaml --preempt-at 0.5:kill,0.5
name: NAME
recipe: recipe:build          # module:function, or a built-in: digits, charlm
args: {hidden: 64, lr: 0.003}
"""

RECIPE = '''\
"""recipe.py: the parts of a training job; spotrun runs the loop (job.yaml names it as recipe:build)."""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from spotrun import Parts, RecipeContext, arg, recipe


@recipe(shape_args=["hidden"])  # changing `hidden` makes a checkpoint unloadable; `lr` is a trajectory change
def build(args: dict[str, Any], ctx: RecipeContext) -> Parts:
    hidden, lr = arg(args, "hidden", int, 64), arg(args, "lr", float, 3e-3)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(4, (4096,), generator=g)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 2
    x = centers[y] + torch.randn(4096, 16, generator=g)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(model(inputs), labels)

    return Parts(model, optimizer, None, TensorDataset(x, y), loss_fn)
'''

SCRIPT_JOB = """\
# A job of an unchanged training script (a Transformers or Lightning Trainer with SpotrunCallback, or any
# script that saves its checkpoints under {checkpoint_dir} and resumes from the newest one there).
# Edit the command to run yours, then: spotrun run job.yaml --preempt-at 0.5:kill,0.5
name: NAME
command: ["{python}", train.py, --output_dir, "{checkpoint_dir}", --max_steps, "{total_steps}"]
total_steps: 600              # what {total_steps} says to the script
checkpoint: {keep: 3}         # the script saves; spotrun validates, uploads and keeps the newest 3
# storage: s3://bucket/prefix  # default: $SPOTRUN_HOME/checkpoints/NAME (a relative path is under it)
"""

KINDS: dict[str, tuple[str, str | None, str | None]] = {
    "loop": (LOOP_JOB + _COMMON, "train.py", LOOP),
    "recipe": (RECIPE_JOB + _COMMON, "recipe.py", RECIPE),
    "script": (SCRIPT_JOB, None, None),
}


def files_for(kind: str, name: str) -> dict[str, str]:
    """File name -> text that `spotrun init --kind KIND --name NAME` writes."""
    job, module, text = KINDS[kind]
    out = {"job.yaml": job.replace("NAME", name)}
    if module is not None and text is not None:
        out[module] = text
    return out


def cmd_init(args: argparse.Namespace) -> int:
    """Write the starter files into the current directory; ConfigError (nothing written) if one exists."""
    from spotrun.trainer.spec.job import parse_spec

    here = Path.cwd()
    wanted = files_for(args.kind, args.name)
    parse_spec(yaml.safe_load(wanted["job.yaml"]), source="--name")  # a name no job may have: one line
    taken = [n for n in wanted if (here / n).exists()]
    if taken:
        raise ConfigError(
            f"{', '.join(taken)} already exist{'s' if len(taken) == 1 else ''} in {here}: nothing written; "
            "run spotrun init in an empty directory, or move them aside"
        )
    for name, text in wanted.items():
        (here / name).write_text(text)
    print(f"wrote {', '.join(wanted)} in {here}")
    print("run it on the local spot simulator: spotrun run job.yaml --preempt-at 0.5:kill,0.5")
    return EXIT_OK


def add_init(sub: Subparsers) -> None:
    help_ = "write a commented job file (and a starter module) for your own loop, recipe or script here"
    p = sub.add_parser("init", help=help_, description=help_)
    p.add_argument(
        "--kind",
        choices=sorted(KINDS),
        default="loop",
        help="loop: your own loop with spotrun.session (default); recipe: parts spotrun trains; "
        "script: an unchanged script run as a command",
    )
    p.add_argument("--name", default="my-job", help="the job's name (default my-job)")
    p.set_defaults(handler=cmd_init)
