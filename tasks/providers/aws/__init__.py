"""The `aws` provider (`kind: aws`): each attempt on fresh EC2 spot instances in one pinned
region, or (`regions`, an opt-in) in one of several.

- `config`: its settings (`AwsProviderConfig`, `LaunchTemplateRef`).
- `provider`: `AwsProvider`, the seam that composes the rooms below (provision, watch, release);
  `clients`: the EC2 clients (`ec2_client`, `make_ec2_client`); `factory`: the registry's `build`.
- `policy`: which (subnet, instance type) pool to try next; `sites`: the regions, their zones, AMIs
  and spot placement scores; `standby`: the live workers a warm standby's zone avoids.
- `launch`: user data, tags and the launch requests; `gang`: launching an attempt's instances (pool
  after pool, or a fleet) until every node runs; `groups`: cluster placement groups; `instances`:
  where an instance landed, and terminating them.
- `watch`: an instance's end and its trainer's heartbeat; `cost`: what an attempt cost; `prices`: an
  hour's price for the budget check; `errors`: every EC2 error mapped to a kind and a line.
- `installation`: this installation's id, on every instance's tags; `sweeper`: terminates the instances
  of dead flow runs; `iam`: least-privilege policies (`python -m tasks.providers.aws.iam`).
- `rehearsal`: `RehearsalProvider`, instances played by local processes against a test endpoint (moto).

The names of modules that load boto3 (clients, provider, rehearsal, factory) are imported on first use
(PEP 562), so that reading settings loads no AWS SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spotrun.tasks.providers.aws.config import AwsProviderConfig as AwsProviderConfig
from spotrun.tasks.providers.aws.config import LaunchTemplateRef as LaunchTemplateRef
from spotrun.tasks.providers.aws.installation import INSTALLATION_FILE as INSTALLATION_FILE
from spotrun.tasks.providers.aws.installation import installation_id as installation_id
from spotrun.tasks.providers.aws.sweeper import sweep as sweep
from spotrun.tasks.providers.aws.sweeper import sweep_flow_run as sweep_flow_run

if TYPE_CHECKING:
    from spotrun.tasks.providers.aws.clients import ec2_client as ec2_client
    from spotrun.tasks.providers.aws.clients import make_ec2_client as make_ec2_client
    from spotrun.tasks.providers.aws.factory import build as build
    from spotrun.tasks.providers.aws.provider import AwsProvider as AwsProvider
    from spotrun.tasks.providers.aws.rehearsal import RehearsalProvider as RehearsalProvider

_LAZY = {
    "AwsProvider": "provider",
    "ec2_client": "clients",
    "make_ec2_client": "clients",
    "RehearsalProvider": "rehearsal",
    "build": "factory",
}


def __getattr__(name: str) -> Any:
    """A name of a module that loads boto3, imported on its first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
