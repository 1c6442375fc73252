"""charlm recipe: it trains, its data is a pure function of (seed, epoch, index), its size estimate holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from spotrun.trainer import recipes
from spotrun.trainer.errors import ConfigError
from spotrun.trainer.recipes import RecipeContext
from spotrun.trainer.recipes.charlm import CharLMConfig, CorpusWindows, param_count, read_corpus, state_bytes

TINY: dict[str, Any] = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "max_corpus_mb": 0.05}
CTX = RecipeContext(seed=3, total_steps=10, batch_size=4, device=torch.device("cpu"))


def _batch(ds: CorpusWindows, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in indices), strict=True)
    return torch.stack(xs), torch.stack(ys)


def _state_nbytes(parts: recipes.Parts) -> int:
    model = sum(t.numel() * t.element_size() for t in parts.model.state_dict().values())
    adam = sum(
        t.numel() * t.element_size()
        for s in parts.optimizer.state.values()
        for k, t in s.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return model + adam


def test_trains_a_few_steps() -> None:
    torch.manual_seed(0)
    parts = recipes.build("charlm", TINY, CTX)
    before = [p.detach().clone() for p in parts.model.parameters()]
    for step in range(2):
        loss = parts.loss_fn(parts.model, _batch(parts.dataset, [4 * step + i for i in range(4)]))  # type: ignore[arg-type]
        assert torch.isfinite(loss)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parts.optimizer.step()
        parts.scheduler.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, parts.model.parameters(), strict=True))
    assert 0.0 < parts.optimizer.param_groups[0]["lr"] <= 1e-3


def test_windows_are_a_function_of_seed_epoch_index() -> None:
    corpus = read_corpus(20_000)
    a, b = CorpusWindows(corpus, 16, seed=3), CorpusWindows(corpus, 16, seed=3)
    b[7], b[2]  # drawing other samples first must not matter
    for i in (0, 5, 9):
        assert all(torch.equal(u, v) for u, v in zip(a[i], b[i], strict=True))
    x, y = a[5]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    e0 = a[5][0]
    a.set_epoch(1)
    assert not torch.equal(a[5][0], e0)
    a.set_epoch(0)
    assert torch.equal(a[5][0], e0)
    assert not torch.equal(CorpusWindows(corpus, 16, seed=4)[5][0], e0)
    assert len(a) == (len(corpus) - 1) // 16


def test_corpus_is_deterministic_and_capped() -> None:
    c = read_corpus(30_000)
    assert len(c) == 30_000 and c == read_corpus(30_000)
    assert c.startswith(read_corpus(1_000))


@pytest.mark.parametrize(
    "args",
    [TINY, {**TINY, "d_model": 64, "n_layers": 3, "n_heads": None}, {**TINY, "seq_len": 40}],
)
def test_state_size_estimate(args: dict[str, Any]) -> None:
    parts = recipes.build("charlm", args, CTX)
    assert sum(p.numel() for p in parts.model.parameters()) == param_count(CharLMConfig(args))
    parts.loss_fn(parts.model, _batch(parts.dataset, [0, 1])).backward()  # type: ignore[arg-type]
    parts.optimizer.step()  # AdamW allocates its state on the first step
    assert _state_nbytes(parts) == state_bytes(args)


def test_documented_sizes() -> None:
    mb = 1e6
    assert 0.8 * mb < state_bytes({"d_model": 64, "n_layers": 1}) < 1.3 * mb
    assert 90 * mb < state_bytes({"d_model": 384, "n_layers": 5}) < 120 * mb
    assert 1000 * mb < state_bytes({"d_model": 1024, "n_layers": 7}) < 1100 * mb


def test_weights_are_not_shared_so_safetensors_saves_them(tmp_path: Path) -> None:
    parts = recipes.build("charlm", TINY, CTX)
    sd = parts.model.state_dict()
    save_file(sd, str(tmp_path / "m.safetensors"))
    back = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(back) == sorted(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize(
    "args", [{"d_modle": 64}, {"d_model": 30, "n_heads": 4}, {"dropout": 1.5}, {"seq_len": 0}]
)
def test_bad_args_are_config_errors(args: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="charlm"):
        recipes.build("charlm", args, CTX)
