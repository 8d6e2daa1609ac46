"""Placement of a run's processes: teacher replicas and rollout actors on Ray.

    config.py    ClusterConfig, TeacherReplicas, StudentWorkers (the `cluster:` section)
    session.py   RayCluster: connect to Ray, start teacher groups, hand out their pools
    teachers.py  TeacherReplica / TeacherGroup: supervised `opd serve-teacher` actors
    pool.py      ReplicaPool: one teacher's replicas behind TeacherClient's API
    rollout.py   RolloutWorker / RolloutPool / PoolEngine: sampling on Ray actors
    cores.py     OpenMP's wait policy when the trainer forks its teachers onto its own cores

Import from the modules: this file imports nothing, so the config loads without torch.
"""
