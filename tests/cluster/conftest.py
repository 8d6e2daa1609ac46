"""A local Ray cluster per test module (Ray's local_mode no longer exists)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, namespace="opd-test", log_to_driver=False)
    yield ray
    ray.shutdown()
