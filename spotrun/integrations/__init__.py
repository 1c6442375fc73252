"""Framework callbacks that bring an existing training script to spotrun unchanged but for one line
(docs/integrations.md): `spotrun.integrations.transformers.SpotrunCallback` for a Transformers Trainer,
`spotrun.integrations.lightning.SpotrunCallback` for a Lightning Trainer.

They run on the worker, inside a `command:` job's script, and import only the trainer's side of that
link (trainer/command/link.py) and their framework: no Prefect, nothing of the controller.
"""
