"""pl_train.py: a small MLP trained with the Lightning Trainer."""

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from spotrun.integrations.lightning import SpotrunCallback


class MLP(L.LightningModule):
    """Two layers with dropout between them: what it drops comes from the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def points(n: int = 64) -> TensorDataset:
    """Random points and labels from their own generator: the same on every worker."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(4, (n,), generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max_steps", type=int, default=60)
    a = p.parse_args()
    L.seed_everything(0)
    model = MLP()
    cb = SpotrunCallback()
    saves = ModelCheckpoint(
        dirpath=a.out,
        filename="{epoch}-{step}",
        every_n_train_steps=10,
        save_top_k=3,
        monitor="step",
        mode="max",
    )
    trainer = L.Trainer(
        max_steps=a.max_steps,
        accelerator="cpu",
        callbacks=[saves, cb],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(points(), batch_size=64, shuffle=True)  # one batch an epoch: see below
    trainer.fit(model, data, ckpt_path=cb.resume_from)


if __name__ == "__main__":
    main()
