"""Supervised fine-tuning: `opd sft`, the recipe's start point.

    config.py    SFTConfig: model, data, optim, run and cluster sections (the spine's where they fit)
    trainer.py   the loop: one set per batch, response-only cross-entropy, the spine's
                 optimizer step and run directory
    cli.py       `opd sft CONFIG.yaml`
"""
