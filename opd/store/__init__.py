"""The teacher logit store: a teacher's answers on a fixed set of sequences, scored once and
replayed by `opd train` with no teacher running.

    config.py  `opd store`'s config (StoreConfig) and the train config's `store:` section (StoredSource)
    shards.py  the on-disk format: sharded .npz answers, a JSON manifest, atomic writes, checks on read
    write.py   `opd store`'s work: the sequences (a prompt/response JSONL, or the student's own
               rollouts), one teacher server's top-k answers on them, written shard by shard (resumable)
    cli.py     `opd store CONFIG`

A stored answer is what a live top-k answer is: per response row the teacher's k ids and
log-probs, the exact tail log-mass (the mass outside the k), and the sampled token's
log-prob; so the stored loss is the same exact {top-k, tail} objective (docs/train.md).
What `opd train` reads from a store (a TeacherSet answered from it, the stored sequences as
Batches) is opd/distill/stored.py, on the trainer's floor.
"""
