"""On-policy distillation: `opd train` (and `opd probe`, the check before a run).

    config.py    TrainConfig: student, merge, rollout, loss, optim, teacher_client, run, cluster
    cli.py       `opd train CONFIG.yaml`
    trainer.py   Trainer: setup, then `step()` top to bottom, evaluation, checkpoints, card
    prompts.py   the prompt sets: loaded, routed once, held to the teachers' lengths
    batch.py     Batch (prompts, routes, rollouts, teacher futures) and the look-ahead Prefetcher
    teachers.py  TeacherSet: checked connections, answers as futures, full-vocabulary RowStreams
    context.py   what a teacher sees (its `context:` prompt) and where it looks (mode student_topk)
    launch.py    RunTeachers: the teacher servers cluster.mode fork / ray starts, and their watchdog
    loss.py      the objective of a batch: each teacher's rows, weighted, backward per micro-batch
    stats.py     StepStats (one step's measurements) and History (the run's, for the card)
    evaluate.py  held-out KL to each prompt's teacher and verifier accuracy
    card.py      the training card
    probe.py     `opd probe`: initial KL, top-k overlap and tail mass of a student and a teacher

The shared parts (model loading, rollout engine, optimizer, run directory, response rows)
are the training spine's (opd/spine).
"""
