"""The training spine: what `opd sft`, `opd train` and `opd rl` do alike, in one place.

A loop owns its objective (cross-entropy, a teacher divergence, a group-relative advantage)
and calls the spine for everything else:

    config.py   the shared config sections: ModelConfig, RolloutConfig, OptimConfig, RunConfig
    model.py    load_policy (the one loader: dtype, device, LoRA, checkpointing, dropout),
                make_engine (the rollout engine: hf or vLLM)
    optim.py    build_optimizer (AdamW + schedule), optimizer_step (clip, skip a non-finite
                step), NonfiniteSteps, align_schedule after a resume, TrainError
    run.py      RunDir: claim, resume (refusing a changed objective), checkpoints, metrics,
                final model and plots
    dist.py     the ranks of a sharded run (World, init_world, launch), FSDP2 sharding, the
                few collectives the loops need
    shards.py   sharded checkpoints (torch.distributed.checkpoint), the whole model gathered
    rows.py     response rows of a packed batch: packing, masks, per-row weights, the
                student's rows (with or without its LM head), trimming after the answer

New capabilities land here rather than in a fourth loop: sharding (FSDP2) is `load_policy`
given a World, `RunDir` writing sharded checkpoints, and each loop taking its share of a step;
a loss that combines a reward advantage with a teacher signal is a new objective over the same
rows.

Import from the modules (`from opd.spine.model import load_policy`): this file imports
nothing, so a config can be loaded and checked without loading torch.
"""
