"""charlm: a byte-level decoder-only transformer trained on the Python standard library's own source.

The corpus needs no download: the .py files under `sysconfig.get_paths()["stdlib"]`, walked in
sorted order and cut at `max_corpus_mb`, so every process on the same Python reads the same bytes.

State size (parameters + AdamW exp_avg + exp_avg_sq, fp32: ~12 bytes per parameter) is set by
`d_model` and `n_layers`; `state_bytes(args)` computes it without building anything:

    ~1 MB      d_model=64,   n_layers=1
    ~10 MB     d_model=128,  n_layers=4     (the defaults)
    ~50 MB     d_model=256,  n_layers=5
    ~100 MB    d_model=384,  n_layers=5
    ~1 GB      d_model=1024, n_layers=7     (89M parameters)

The output head is not tied to the embedding: safetensors refuses tensors that share storage.

`evaluate` measures the loss on the stdlib source that follows the training corpus's cut (the next
`EVAL_BYTES`, never trained on), in `EVAL_WINDOWS` windows at fixed, evenly spaced offsets. Where the
whole stdlib fits in `max_corpus_mb` there is nothing after the cut, and the windows come from the
training corpus instead (then not held out: a log line says so).
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from spotrun.trainer.recipes import Evaluate, Parts, RecipeContext, arg, evaluating, recipe, warmup_cosine
from spotrun.trainer.recipes.data import sample_generator

log = logging.getLogger(__name__)

VOCAB = 256  # bytes
EVAL_BYTES = 1 << 16  # held out: the stdlib source after the training corpus's cut
EVAL_WINDOWS, EVAL_BATCH = 32, 8
DEFAULTS: dict[str, Any] = {
    "d_model": 128,
    "n_layers": 4,
    "n_heads": None,  # None: d_model // 64, at least 1
    "seq_len": 128,
    "dropout": 0.1,
    "lr": 1e-3,
    "warmup": 20,
    "max_corpus_mb": 2.0,
    # The sample of the corpus a scheduled run trains on (`partition: "{scheduled_date}"` in a keyed
    # job): each name draws its own windows. Empty: the windows drawn before the arg existed.
    "partition": "",
}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CharLMConfig:
    """The recipe's args, checked: a bad value fails here with what to change."""

    def __init__(self, args: dict[str, Any]) -> None:
        a = {**DEFAULTS, **args}  # unknown args: refused by recipes.check_args (@recipe(args=DEFAULTS))
        self.d_model, self.n_layers = arg(a, "d_model", int, 128), arg(a, "n_layers", int, 4)
        self.seq_len = arg(a, "seq_len", int, 128)
        self.n_heads = arg(a, "n_heads", int, 1) if a["n_heads"] is not None else max(1, self.d_model // 64)
        self.dropout, self.lr = arg(a, "dropout", float, 0.1), arg(a, "lr", float, 1e-3)
        self.warmup, self.max_corpus_mb = arg(a, "warmup", int, 20), arg(a, "max_corpus_mb", float, 2.0)
        if min(self.d_model, self.n_layers, self.seq_len, self.n_heads) < 1:
            raise ValueError("d_model, n_layers, n_heads and seq_len must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout} must be in [0, 1)")
        if self.max_corpus_mb <= 0:
            raise ValueError("max_corpus_mb must be > 0")


def param_count(cfg: CharLMConfig) -> int:
    """Parameters of the model `cfg` describes (matches `CharLM(cfg)` exactly)."""
    d = cfg.d_model
    block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, mlp 8d^2+5d, two LayerNorms 4d
    embeddings = VOCAB * d + cfg.seq_len * d
    head = d * VOCAB + VOCAB + 2 * d  # final LayerNorm and the untied output layer
    return cfg.n_layers * block + embeddings + head


def state_bytes(args: dict[str, Any]) -> int:
    """Bytes of model + AdamW state for these args: fp32 params, exp_avg and exp_avg_sq."""
    return 12 * param_count(CharLMConfig(args))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).transpose(1, 3).unbind(2)
        )
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), p, self.training)
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, cfg: CharLMConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(cfg.seq_len, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(d, cfg.n_heads, cfg.dropout) for _ in range(cfg.n_layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2 init; residual projections scaled down by depth
                std = (
                    0.02 / math.sqrt(2 * cfg.n_layers)
                    if name.endswith(("proj.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def read_corpus(max_bytes: int) -> bytes:
    """The stdlib's .py files in sorted path order, concatenated and cut at `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[bytes] = []
    n = 0
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for f in sorted(files):
            if n >= max_bytes:
                return b"".join(out)[:max_bytes]
            if f.endswith(".py"):
                data = (Path(dirpath) / f).read_bytes()
                out.append(data)
                n += len(data)
    return b"".join(out)[:max_bytes]


class CorpusWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Window i of an epoch starts at an offset drawn from (seed, epoch, i) alone, so any sample can
    be produced again without replaying the ones before it (exact resume, any worker count)."""

    def __init__(self, corpus: bytes, seq_len: int, seed: int) -> None:
        if len(corpus) < seq_len + 2:
            raise ValueError(
                f"corpus of {len(corpus)} bytes is shorter than seq_len {seq_len}; lower seq_len"
            )
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self.seq_len, self.seed, self.epoch = seq_len, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = sample_generator(self.seed, self.epoch, i)
        start = int(torch.randint(len(self.data) - self.seq_len, (1,), generator=g))
        w = self.data[start : start + self.seq_len + 1].long()
        return w[:-1], w[1:]


@recipe(shape_args={"d_model", "n_layers", "n_heads", "seq_len"}, args=DEFAULTS)
def build(args: dict[str, Any], ctx: RecipeContext) -> Parts:
    cfg = CharLMConfig(args)
    model = CharLM(cfg).to(ctx.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(ctx.total_steps, cfg.warmup))
    size = int(cfg.max_corpus_mb * 2**20)
    corpus = read_corpus(size + EVAL_BYTES)  # read_corpus(size) is its prefix: training reads the same
    partition = arg(args, "partition", str, "")
    data_seed = ctx.seed ^ zlib.crc32(partition.encode()) if partition else ctx.seed
    dataset = CorpusWindows(corpus[:size], cfg.seq_len, data_seed)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = m(x.to(ctx.device))
        return F.cross_entropy(logits.view(-1, VOCAB), y.to(ctx.device).view(-1))

    held = corpus[size:]
    if len(held) < cfg.seq_len + 1:
        log.info("charlm: the whole stdlib is the training corpus; evaluating on it (not held out)")
        held = corpus[:size]
    return Parts(
        model,
        opt,
        sched,
        dataset=dataset,
        loss_fn=loss_fn,
        grad_clip=1.0,
        evaluate=evaluator(held, cfg, ctx.device),
    )


def evaluator(held: bytes, cfg: CharLMConfig, device: torch.device) -> Evaluate:
    """Mean next-byte cross-entropy over `EVAL_WINDOWS` windows of `held` at evenly spaced offsets."""
    data = torch.frombuffer(bytearray(held), dtype=torch.uint8).long()
    last = len(data) - cfg.seq_len - 1
    starts = sorted({last * i // max(1, EVAL_WINDOWS - 1) for i in range(EVAL_WINDOWS)})
    windows = torch.stack([data[s : s + cfg.seq_len + 1] for s in starts])

    def evaluate(m: nn.Module) -> dict[str, float]:
        total = 0.0
        with evaluating(m):
            for i in range(0, len(windows), EVAL_BATCH):
                w = windows[i : i + EVAL_BATCH].to(device)
                logits = m(w[:, :-1])
                total += float(
                    F.cross_entropy(logits.reshape(-1, VOCAB), w[:, 1:].reshape(-1), reduction="sum")
                )
        return {"eval_loss": total / (len(windows) * cfg.seq_len)}

    return evaluate
