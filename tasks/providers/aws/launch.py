"""The EC2 requests of one launch, built by pure functions: the user-data script, tags, the
RunInstances parameters, and for the fleet path a per-attempt launch template and the CreateFleet call.

The instance id is not known before the launch, so the user data asks the instance metadata service
(IMDSv2) for it at boot and uses it as the worker id; SPOTRUN_WORKER_ID, when already set (a test that
plays the instance locally), wins. The launch id, known up front, is the idempotency token and the
`spotrun:worker` tag: a launch whose response was lost can be found by it.

A multi-node attempt (`distributed.nnodes` > 1) is one instance per node. Each node's user data exports
SPOTRUN_NODE_RANK and SPOTRUN_MASTER_ADDR, node 0's private IP, where torchrun meets: node 0 asks the
metadata service for its own (`local-ipv4`); the others are launched once node 0 runs and carry its
address in their user data. As with the worker id, an address already set wins (a rehearsal plays every
node on one host and sets 127.0.0.1). Each node keeps its files under `<workdir>/node<i>`: on EC2 every
instance has its own disk, so this changes nothing there, while a rehearsal needs the nodes' job files
and checkpoint caches apart.

On EC2 the user data runs as root; the trainer does not. The script creates an unprivileged system user
(`spotrun`), gives it SPOTRUN_HOME (mode 0700: the job file and the checkpoint cache) and execs the
trainer as that user through `setpriv` (no new privileges: no setuid binary gives root back). A
rehearsal plays the instance as the current user: SPOTRUN_TRAINER_USER, set and empty, skips the switch.
"""

from __future__ import annotations

import base64
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.aws.policy import Market, Placement
from spotrun.tasks.providers.base import ProvisionError
from spotrun.trainer.interpreter import SAFE_PATH, python_m, spotrun_version

if TYPE_CHECKING:
    from spotrun.trainer.spec.job import JobSpec

USER_DATA_LIMIT = 16 * 1024  # bytes EC2 accepts before base64
IMDS = "http://169.254.169.254/latest"
TRAINER_USER = "spotrun"  # the unprivileged user the trainer runs as on an instance
TAG_LEASE = "spotrun:lease-until"  # epoch seconds; renewed by the watching flow (watch.py)
TAG_INSTALLATION = "spotrun:installation"  # which spotrun installation launched it (installation.py)
TAG_JOB, TAG_ATTEMPT, TAG_FLOW_RUN, TAG_WORKER, TAG_NODE = (
    "spotrun:job",
    "spotrun:attempt",
    "spotrun:flow-run",
    "spotrun:worker",
    "spotrun:node",
)
INSTANCE_RESOURCES = ("instance", "volume")


@dataclass(frozen=True)
class NodeRole:
    """One machine of a multi-node attempt."""

    rank: int  # SPOTRUN_NODE_RANK
    nnodes: int
    master_addr: str | None  # node 0's private IP; None on node 0 itself (it asks the metadata service)


def _from_imds(var: str, path: str) -> str:
    """Bash: set `var` from the instance metadata (IMDSv2: a session token first) unless already set."""
    return f"""if [ -z "${{{var}:-}}" ]; then
  token=$(curl -sf -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 300' {IMDS}/api/token)
  {var}=$(curl -sf -H "X-aws-ec2-metadata-token: $token" {IMDS}/meta-data/{path})
fi
"""


def _node_lines(node: NodeRole | None) -> str:
    """Bash: this machine's node rank and node 0's address, for a multi-node attempt."""
    if node is None:
        return ""
    if node.master_addr is None:
        addr = _from_imds("SPOTRUN_MASTER_ADDR", "local-ipv4")
    else:
        addr = f"SPOTRUN_MASTER_ADDR=${{SPOTRUN_MASTER_ADDR:-{shlex.quote(node.master_addr)}}}\n"
    return f"{addr}export SPOTRUN_NODE_RANK={node.rank} SPOTRUN_MASTER_ADDR\n"


def _as_trainer_user() -> str:
    """Bash: create the trainer's user, hand it SPOTRUN_HOME and set "$@" to the command that switches
    to it; nothing when SPOTRUN_TRAINER_USER is set and empty (a rehearsal: the current user)."""
    return f"""SPOTRUN_TRAINER_USER=${{SPOTRUN_TRAINER_USER-{TRAINER_USER}}}
set --
if [ -n "$SPOTRUN_TRAINER_USER" ]; then
  id -u "$SPOTRUN_TRAINER_USER" >/dev/null 2>&1 || useradd --system --user-group --no-create-home \\
    --home-dir "$SPOTRUN_HOME" --shell /usr/sbin/nologin "$SPOTRUN_TRAINER_USER"
  chown -R "$SPOTRUN_TRAINER_USER:" "$SPOTRUN_HOME"
  chmod 0700 "$SPOTRUN_HOME"
  export HOME="$SPOTRUN_HOME"
  set -- setpriv --reuid="$SPOTRUN_TRAINER_USER" --regid="$SPOTRUN_TRAINER_USER" --init-groups --no-new-privs
fi
"""


# exits 0 only where `python` imports spotrun of exactly this version
VERSION_PROBE = (
    "import sys, importlib.metadata as m, importlib.util as u; "
    'sys.exit(u.find_spec("spotrun") is None or m.version("spotrun") != sys.argv[1])'
)


def _env_lines(env: Mapping[str, str] | None) -> str:
    """Bash: export the job's `env.set` (names checked by the job spec, values quoted)."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in (env or {}).items())


def node_workdir(workdir: str, node: NodeRole | None) -> str:
    """Where a node keeps its job file and cache: `workdir`, or `workdir/node<i>` for a multi-node attempt."""
    return workdir if node is None else f"{workdir.rstrip('/')}/node{node.rank}"


def build_user_data(
    spec_yaml: str,
    extra_args: list[str],
    *,
    python: str,
    workdir: str,
    job: str,
    attempt: int,
    node: NodeRole | None = None,
    env: Mapping[str, str] | None = None,
    manifest_key_file: str | None = None,
) -> str:
    """A bash script that writes the job file to `workdir` and execs the trainer, as the unprivileged
    TRAINER_USER, with the worker id (and, on a node of a multi-node attempt, its node rank and node
    0's address) and the job's `env.set` exported. Nothing of the controller's environment is in it:
    the trainer starts from the instance's own boot environment."""
    spec_b64 = base64.encodebytes(spec_yaml.encode()).decode().rstrip("\n")
    extra = "".join(" " + shlex.quote(a) for a in extra_args)
    which = f", node {node.rank} of {node.nnodes}" if node is not None else ""
    start = shlex.join(python_m("spotrun.trainer", "--config", "job.yaml", python=python))
    trainer = f'exec "$@" {start} --worker-id "$SPOTRUN_WORKER_ID"'
    trainer += extra  # "$@": the switch to TRAINER_USER
    return f"""#!/bin/bash
# spotrun worker: job {job}, attempt {attempt}{which}
set -euo pipefail
{_from_imds("SPOTRUN_WORKER_ID", "instance-id")}export SPOTRUN_WORKER_ID
{_node_lines(node)}export SPOTRUN_HOME={shlex.quote(node_workdir(workdir, node))} PYTHONUNBUFFERED=1
mkdir -p "$SPOTRUN_HOME"
cd "$SPOTRUN_HOME"
base64 -d > job.yaml <<'SPOTRUN_JOB_B64'
{spec_b64}
SPOTRUN_JOB_B64
{_version_check(python)}{_env_lines(env)}{_key_lines(manifest_key_file)}{_as_trainer_user()}{trainer}
"""


def _version_check(python: str) -> str:
    """Bash: refuse to start a trainer of another spotrun version than the controller's (the image's
    spotrun is the worker's code), saying which version the worker needs; nothing for an uninstalled tree."""
    wanted = spotrun_version()
    if wanted == "0+unknown":
        return ""
    probe = shlex.join([python, SAFE_PATH, "-c", VERSION_PROBE, wanted])
    need = shlex.quote(
        f"spotrun: this worker needs spotrun {wanted} on the image ({python}): pip install spotrun=={wanted}"
    )
    return f"if ! {probe}; then echo {need} >&2; exit 3; fi\n"


def _key_lines(path: str | None) -> str:
    """Bash: SPOTRUN_MANIFEST_KEY from a file on the instance (read as root, before the switch to the
    trainer's user); the key itself never travels in user data, which the account can read back."""
    if not path:
        return ""
    return f"SPOTRUN_MANIFEST_KEY=$(cat {shlex.quote(path)})\nexport SPOTRUN_MANIFEST_KEY\n"


def user_data_for(
    cfg: AwsProviderConfig, job: JobSpec, attempt: int, *, text: str, extra_args: list[str]
) -> Callable[[NodeRole | None], str]:
    """Each node's user data for one attempt of `job` (None: a single-node job) from its job file's
    `text`; a ProvisionError (not retryable) where EC2 would refuse it."""

    def script(node: NodeRole | None) -> str:
        s = build_user_data(
            text,
            extra_args,
            python=cfg.python,
            workdir=cfg.workdir,
            job=job.name,
            attempt=attempt,
            node=node,
            env=job.env.set_,
            manifest_key_file=cfg.manifest_key_file,
        )
        if problem := check_user_data(s):
            raise ProvisionError(problem, retryable=False)
        return s

    return script


def check_user_data(script: str) -> str | None:
    """Why EC2 would refuse this user data, or None."""
    size = len(script.encode())
    if size > USER_DATA_LIMIT:
        return f"the user data is {size} bytes, over EC2's {USER_DATA_LIMIT}: shorten the job file"
    return None


def launch_tags(
    cfg: AwsProviderConfig,
    job: str,
    attempt: int,
    *,
    launch_id: str,
    flow_run_id: str | None,
    installation: str | None = None,
) -> dict[str, str]:
    """Tags on every resource of the launch. Without a flow run id or an installation id there is no
    `spotrun:flow-run` or `spotrun:installation` tag, and the sweeper never touches the instance."""
    tags = {**cfg.tags, "Name": f"spotrun-{job}-a{attempt}", TAG_JOB: job, TAG_ATTEMPT: str(attempt)}
    tags[TAG_WORKER] = launch_id
    tags[TAG_LEASE] = lease_value(cfg.lease_s)
    if flow_run_id:
        tags[TAG_FLOW_RUN] = flow_run_id
    if installation:
        tags[TAG_INSTALLATION] = installation
    return tags


def node_tags(tags: dict[str, str], node: NodeRole | None) -> dict[str, str]:
    """The launch's tags for one node's instance: its index in `spotrun:node` and in its Name."""
    if node is None:
        return tags
    return {**tags, "Name": f"{tags['Name']}-n{node.rank}", TAG_NODE: str(node.rank)}


def placement_group_name(launch_id: str, try_index: int) -> str:
    """A cluster placement group per launch try: a try that fails leaves its instances shutting down in
    the group's zone, and the next try may go to another zone."""
    return f"spotrun-{launch_id}-{try_index}"


def lease_value(lease_s: float, now: float | None = None) -> str:
    """The lease tag's value: until when the instance may run without a flow watching it."""
    return str(int((time.time() if now is None else now) + lease_s))


def tag_specs(tags: dict[str, str], *resource_types: str) -> list[dict[str, Any]]:
    """The TagSpecifications parameter: the same tags on each resource type."""
    pairs = [{"Key": k, "Value": v} for k, v in tags.items()]
    return [{"ResourceType": rt, "Tags": pairs} for rt in resource_types]


def market_options(cfg: AwsProviderConfig, market: Market) -> dict[str, Any]:
    """RunInstances' InstanceMarketOptions (empty for on-demand)."""
    if market == "on-demand":
        return {}
    spot: dict[str, Any] = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
    if cfg.max_price is not None:
        spot["MaxPrice"] = cfg.max_price
    return {"InstanceMarketOptions": {"MarketType": "spot", "SpotOptions": spot}}


def instance_settings(cfg: AwsProviderConfig, root_device: str | None) -> dict[str, Any]:
    """What RunInstances and a launch template's data share: image, volume, profile, network, IMDS."""
    out: dict[str, Any] = {
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
    }
    if cfg.image_id is not None:
        out["ImageId"] = cfg.image_id
    if root_device is not None:
        ebs: dict[str, Any] = {
            "VolumeSize": cfg.root_volume_gb,
            "VolumeType": "gp3",
            "DeleteOnTermination": True,
            "Encrypted": cfg.encrypted,
        }
        if cfg.kms_key_id:
            ebs["KmsKeyId"] = cfg.kms_key_id
        out["BlockDeviceMappings"] = [{"DeviceName": root_device, "Ebs": ebs}]
    if cfg.instance_profile:
        key = "Arn" if cfg.instance_profile.startswith("arn:") else "Name"
        out["IamInstanceProfile"] = {key: cfg.instance_profile}
    if cfg.security_groups:
        out["SecurityGroupIds"] = list(cfg.security_groups)
    if cfg.key_name:
        out["KeyName"] = cfg.key_name
    return out


def run_instances_params(
    cfg: AwsProviderConfig,
    placement: Placement,
    user_data: str,
    *,
    tags: dict[str, str],
    launch_id: str,
    root_device: str | None,
    placement_group: str | None = None,
) -> dict[str, Any]:
    """RunInstances for one instance in one pool (boto3 base64-encodes UserData itself)."""
    params: dict[str, Any] = {
        "MinCount": 1,
        "MaxCount": 1,
        "InstanceType": placement.instance_type,
        "UserData": user_data,
        "ClientToken": launch_id,
        "TagSpecifications": tag_specs(tags, *INSTANCE_RESOURCES),
        **instance_settings(cfg, root_device),
        **market_options(cfg, placement.market),
    }
    if cfg.launch_template is not None:
        params["LaunchTemplate"] = cfg.launch_template.spec()
    if placement.subnet is not None:
        params["SubnetId"] = placement.subnet
    if placement_group is not None:
        params["Placement"] = {"GroupName": placement_group}
    return params


def template_data(
    cfg: AwsProviderConfig,
    user_data: str,
    tags: dict[str, str],
    *,
    root_device: str | None,
    base: dict[str, Any] | None = None,
    placement_group: str | None = None,
) -> dict[str, Any]:
    """LaunchTemplateData of the per-attempt template a fleet launches from: `base` (the configured
    template's data, if any) with this attempt's user data, tags and settings on top. A fleet's
    template may not carry market options: the fleet request says spot or on-demand."""
    data = {k: v for k, v in (base or {}).items() if k not in ("InstanceMarketOptions", "UserData")}
    data.update(instance_settings(cfg, root_device))
    data["UserData"] = base64.b64encode(user_data.encode()).decode()
    data["TagSpecifications"] = tag_specs(tags, *INSTANCE_RESOURCES)
    if placement_group is not None:
        data["Placement"] = {"GroupName": placement_group}
    return data


def fleet_params(
    cfg: AwsProviderConfig, template_id: str, pools: list[Placement], *, tags: dict[str, str], market: Market
) -> dict[str, Any]:
    """An instant fleet of one instance over `pools` (ranked best first): spot by the configured
    allocation strategy (capacity-optimized-prioritized: each type's Priority is its place in
    instance_types, 0 the most wanted), on-demand by the ranking (prioritized)."""
    prioritized = market == "spot" and cfg.spot_allocation_strategy == "capacity-optimized-prioritized"
    overrides = []
    for i, p in enumerate(pools):
        o: dict[str, Any] = {"InstanceType": p.instance_type}
        if p.subnet is not None:
            o["SubnetId"] = p.subnet
        if market == "spot" and cfg.max_price is not None:
            o["MaxPrice"] = cfg.max_price
        if market == "on-demand":
            o["Priority"] = float(i)
        elif prioritized:
            o["Priority"] = float(cfg.instance_types.index(p.instance_type))
        overrides.append(o)
    params: dict[str, Any] = {
        "Type": "instant",
        "LaunchTemplateConfigs": [
            {
                "LaunchTemplateSpecification": {"LaunchTemplateId": template_id, "Version": "1"},
                "Overrides": overrides,
            }
        ],
        "TargetCapacitySpecification": {"TotalTargetCapacity": 1, "DefaultTargetCapacityType": market},
        "TagSpecifications": tag_specs(tags, "fleet"),
    }
    if market == "spot":
        params["SpotOptions"] = {
            "AllocationStrategy": cfg.spot_allocation_strategy,
            "InstanceInterruptionBehavior": "terminate",
        }
    else:
        params["OnDemandOptions"] = {"AllocationStrategy": "prioritized"}
    return params
