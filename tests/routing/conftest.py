"""Fixtures of the routing tests."""

from __future__ import annotations

import pytest
from routing_prompts import labelled_prompts


@pytest.fixture(scope="session")
def routing_classifier_file(tmp_path_factory):
    """A classifier fitted on 120 prompts per domain, saved as JSON."""
    from opd.routing.classifier import fit

    rows = labelled_prompts(120, seed=0)
    clf = fit([x for x, _ in rows], [y for _, y in rows])
    return clf.save(tmp_path_factory.mktemp("router") / "router.json")
