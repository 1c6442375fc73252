"""`spotrun pool list|stop`: the trainer pools (`provider.pool`) of this SPOTRUN_HOME.

A pool's server ends by itself after `pool_idle_s` without a request; `stop` is for an operator who
wants it gone sooner (to pick up a new torch, or free its memory): it stops taking requests at once
and ends when its running trainers have."""

from __future__ import annotations

import argparse

from spotrun.console import EXIT_OK, Subparsers


def cmd_list(args: argparse.Namespace) -> int:
    """One line per pool: its server's pid, running trainers and interpreter, or `stale`."""
    from spotrun.tasks.providers.local import pool
    from spotrun.tasks.settings import spotrun_home

    directory = pool.pools_dir(spotrun_home())
    found = pool.running(directory)
    if not found:
        print(f"no trainer pools under {directory}")
    for p in found:
        if p.pid is None:
            print(f"{p.name}: stale socket (no server; the next job that names it starts one)")
        else:
            print(f"{p.name}: pid {p.pid}, {p.trainers} trainer(s) running, {p.python}")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop one pool's server: no new trainers from it; it ends once its running ones have."""
    from spotrun.tasks.providers.local import pool
    from spotrun.tasks.providers.local.config import pool_name_refusal
    from spotrun.tasks.settings import spotrun_home
    from spotrun.trainer.errors import ConfigError

    why = pool_name_refusal(args.name)
    if why is not None:
        raise ConfigError(why)
    pid = pool.stop(pool.Place(pool.pools_dir(spotrun_home()), args.name))
    if pid is None:
        print(f"no server for trainer pool {args.name}")
    else:
        print(f"trainer pool {args.name} (pid {pid}) takes no more requests; it ends when its trainers have")
    return EXIT_OK


def add_pool(sub: Subparsers) -> None:
    help_ = "list or stop the shared trainer fork servers (provider.pool) of this host"
    p = sub.add_parser("pool", help=help_, description=help_)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="each pool: pid, running trainers, interpreter").set_defaults(
        handler=cmd_list
    )
    stop = actions.add_parser("stop", help="stop a pool's server once its running trainers have ended")
    stop.add_argument("name", metavar="NAME")
    stop.set_defaults(handler=cmd_stop)
