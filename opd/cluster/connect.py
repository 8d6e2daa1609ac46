"""Join or start the Ray cluster of a `cluster:` section. Apart from session.py so that what
starts the student's ranks (ranks.py, imported by the training CLIs) loads without torch."""

from __future__ import annotations

from opd.cluster.config import ClusterConfig


def connect(cfg: ClusterConfig) -> bool:
    """Connect this process to Ray as `cfg` says (idempotent); whether this call connected it,
    which makes the caller the one to shut the session down."""
    import ray   # optional, and about a second to import

    if ray.is_initialized():
        return False
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, namespace=cfg.namespace, include_dashboard=False)
    else:
        ray.init(address=cfg.address, namespace=cfg.namespace)
    return True
