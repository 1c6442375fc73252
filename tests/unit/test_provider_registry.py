"""The provider registry (tasks/providers/registry.py): its kinds are the config union's, each entry's key
is its model's `kind`, and each factory resolves. Pure tables, no provider is started."""

from __future__ import annotations

import importlib
from typing import get_args

import pytest
from pydantic import ValidationError

from spotrun.tasks.providers.registry import PROVIDERS, ProviderConfig, capacity, kinds, parse_provider_config


def test_the_registry_and_the_config_union_name_the_same_models() -> None:
    assert {r.config for r in PROVIDERS.values()} == set(get_args(ProviderConfig))


@pytest.mark.parametrize("kind", sorted(PROVIDERS))
def test_each_kind_is_its_models_kind_and_its_factory_resolves(kind: str) -> None:
    entry = PROVIDERS[kind]
    assert entry.config.model_fields["kind"].default == kind  # type: ignore[attr-defined]
    assert callable(getattr(importlib.import_module(entry.module), entry.factory))


def test_settings_are_parsed_by_their_kind() -> None:
    assert type(parse_provider_config({"kind": "local"})) is PROVIDERS["local"].config
    with pytest.raises(ValidationError) as e:
        parse_provider_config({"kind": "local", "region": "x"})
    assert e.value.errors()[0]["loc"] == ("local", "region")  # led by the kind (spotrun run's messages)
    assert kinds() == "`kind: local` or `kind: aws`"


@pytest.mark.parametrize(
    ("kind", "expected"), [("local", "spot (simulated)"), ("aws", "unknown"), ("gone-kind", "unknown")]
)
def test_what_a_kinds_workers_run_on_where_no_cost_says(kind: str, expected: str) -> None:
    assert capacity(kind) == expected
