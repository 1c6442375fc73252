"""hf_train.py: a tiny GPT-2 trained with the Transformers Trainer."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from spotrun.integrations.transformers import SpotrunCallback


class Tokens(torch.utils.data.Dataset):
    """Random token sequences from their own generator: the same on every worker."""

    def __init__(self, n: int, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=60)
    a = p.parse_args()
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=10,
        save_steps=10,
        save_total_limit=3,
        logging_steps=5,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        report_to="none",
        use_cpu=True,
    )
    set_seed(args.seed)  # before the model: its initial weights
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(512), callbacks=[SpotrunCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(a.output_dir))


if __name__ == "__main__":
    main()
