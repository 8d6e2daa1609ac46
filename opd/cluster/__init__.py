"""Placement of a run's processes: teacher replicas, rollout actors and the student's ranks on Ray.

    config.py    ClusterConfig, TeacherReplicas, StudentWorkers (the `cluster:` section)
    connect.py   connect: join or start the Ray cluster a `cluster:` section names
    session.py   RayCluster: start teacher groups, hand out their pools
    ranks.py     RankActor / launch: a sharded student's ranks as Ray actors in a placement group
    teachers.py  TeacherReplica / TeacherGroup: supervised `opd serve-teacher` actors
    pool.py      ReplicaPool: one teacher's replicas behind TeacherClient's API
    rollout.py   RolloutWorker / RolloutPool / PoolEngine: sampling on Ray actors
    cores.py     OpenMP's wait policy when the trainer forks its teachers onto its own cores

Import from the modules: this file imports nothing, so the config loads without torch.
"""
