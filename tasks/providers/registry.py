"""Provider kinds: the one table that says, for each `kind`, which settings model it takes and which
factory builds its workers' provider.

A new provider is one package beside local/ and aws/ (a settings model with a `kind` Literal that
implements `base.ProviderSettings`, a `base.Provider`, and a factory `build(cfg, workdir, flow_run_id)`)
plus its line here: its model in `ProviderConfig` and its entry in `PROVIDERS` (a test holds the two
equal). Nothing else switches on the kind: the controller asks the settings (`ProviderSettings`) and the
provider (`Provider`). A factory's module is imported on the first build of its kind, so that reading
settings loads no cloud SDK.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, TypeAdapter

from spotrun.tasks.providers.aws.config import AwsProviderConfig
from spotrun.tasks.providers.local.config import LocalProviderConfig

if TYPE_CHECKING:
    from spotrun.tasks.providers.base import Provider, ProviderSettings

# Every kind's settings: the flow's parameter type. A plain union (JSON schema anyOf), not a
# discriminated one (oneOf): the Prefect UI offers anyOf as a choice, then that provider's form; oneOf it
# shows as raw JSON. Either validates the same: `kind` is a Literal in each, and each forbids extra keys.
ProviderConfig = LocalProviderConfig | AwsProviderConfig


@dataclass(frozen=True)
class Registered:
    """One kind: its settings model, and the factory `module.factory(cfg, workdir, flow_run_id)`."""

    config: type[ProviderSettings]
    module: str  # imported on the first build of the kind
    factory: str = "build"
    capacity: str = "unknown"  # what its workers run on, for reports, where an attempt's cost names no market


PROVIDERS: dict[str, Registered] = {
    "local": Registered(
        LocalProviderConfig, "spotrun.tasks.providers.local.provider", capacity="spot (simulated)"
    ),
    "aws": Registered(AwsProviderConfig, "spotrun.tasks.providers.aws.factory"),
}


def build_provider(cfg: ProviderConfig, workdir: Path, flow_run_id: str) -> Provider:
    """The provider for `cfg`; workers that keep files on this machine keep them under `workdir` unless
    the settings name a directory."""
    entry = PROVIDERS[cfg.kind]
    factory: Any = getattr(importlib.import_module(entry.module), entry.factory)
    provider: Provider = factory(cfg, workdir, flow_run_id or None)
    return provider


def capacity(kind: str) -> str:
    """What workers of `kind` (a provider's name in the history) run on, where their cost names no market."""
    entry = PROVIDERS.get(kind)
    return entry.capacity if entry is not None else "unknown"


def kinds() -> str:
    """The kinds, for messages: "`kind: local` or `kind: aws`"."""
    return " or ".join(f"`kind: {k}`" for k in PROVIDERS)


def parse_provider_config(data: Any) -> ProviderConfig:
    """Settings (a mapping with `kind`) as their kind's model; pydantic's ValidationError, its first
    error's location led by the kind, otherwise."""
    return _tagged().validate_python(data)


@functools.cache
def _tagged() -> TypeAdapter[ProviderConfig]:
    return TypeAdapter(Annotated[ProviderConfig, Field(discriminator="kind")])
