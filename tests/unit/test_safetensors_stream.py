"""The streamed model file is the safetensors library's file, byte for byte, and loads back."""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load, save

from spotrun.trainer import recipes
from spotrun.trainer.checkpoint import safetensors_stream
from spotrun.trainer.checkpoint.format import model_metadata


def streamed(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    out = io.BytesIO()
    safetensors_stream.write(out, tensors, metadata)
    return out.getvalue()


EVERY_DTYPE = {
    f"t{i}": torch.arange(6).reshape(2, 3).to(dt)
    for i, dt in enumerate(
        [
            torch.bool,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.float16,
            torch.bfloat16,
            torch.int32,
            torch.float32,
            torch.float64,
            torch.int64,
        ]
    )
}


@pytest.mark.parametrize(
    "tensors",
    [
        EVERY_DTYPE,
        {
            "b": torch.zeros(3),
            "a": torch.ones(2, dtype=torch.bfloat16),
            "é": torch.zeros(1, dtype=torch.int64),
        },
        {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4), "w": torch.randn(5, 7)},
        {"w": torch.randn(4, 4).t()},  # not contiguous: written in its logical order, as the library wants
    ],
    ids=["every-dtype", "names", "shapes", "transposed"],
)
@pytest.mark.parametrize("metadata", [model_metadata(1200), {}, None], ids=["metadata", "empty", "none"])
def test_same_bytes_as_the_library(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
    data = streamed(tensors, metadata)
    assert data == save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    back = load(data)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_recipe_model_is_the_same_file() -> None:
    ctx = recipes.RecipeContext(seed=0, total_steps=10, batch_size=2, device=torch.device("cpu"))
    parts = recipes.build("charlm", {"d_model": 64, "n_layers": 2}, ctx)
    state = {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    assert streamed(state, model_metadata(7)) == save(state, metadata=model_metadata(7))


def test_other_dtypes_fall_back_to_the_library() -> None:
    tensors = {"c": torch.ones(2, dtype=torch.complex64), "f": torch.ones(3)}
    assert safetensors_stream.header(tensors, None) is None
    assert streamed(tensors, None) == save(tensors)
