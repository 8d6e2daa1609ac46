"""Supervised fine-tuning: `opd sft`, the recipe's start point.

    config.py    SFTConfig (flat YAML keys), TinyModelSpec, SFTDataset
    trainer.py   the loop: one set per batch, response-only cross-entropy, the spine's
                 optimizer step and run directory
    cli.py       `opd sft CONFIG.yaml`
"""
