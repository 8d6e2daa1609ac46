"""Multi-teacher routing: which teacher scores which sample, mixtures of domains, loss balance.

    router.py      Router, Route: rules tried in order (domain field, patterns, keywords,
                   classifier, fallback), pass-rate weighting, per-rule/teacher counts
    classifier.py  a small numpy text classifier (fit / save JSON / load / predict_proba)
    mixture.py     MixtureSampler: batches in fixed domain proportions, resumable exactly
    normalize.py   DomainLossNormalizer (running-mean scaling), loss shares, lopsided()
    checks.py      check_teachers: reachable, same tokenizer, mode and k supported
    merge.py       load_merge_config (paths relative to the file), load_datasets
    config.py      the MergeConfig schema
    cli.py         `opd route fit | explain`
"""

from opd.routing.checks import TeacherCheckError, check_teachers
from opd.routing.classifier import Classifier, fit
from opd.routing.config import DatasetSpec, MergeConfig, RouterConfig, RuleSpec, SFTSpec, TeacherSpec
from opd.routing.merge import load_datasets, load_merge_config, mixture_ratios, resolve_merge_paths
from opd.routing.mixture import MixtureSampler
from opd.routing.normalize import DomainLossNormalizer, lopsided
from opd.routing.router import Route, Router, RoutingError

__all__ = [
    "Classifier", "DatasetSpec", "DomainLossNormalizer", "MergeConfig", "MixtureSampler", "Route", "Router",
    "RouterConfig", "RoutingError", "RuleSpec", "SFTSpec", "TeacherCheckError", "TeacherSpec", "check_teachers",
    "fit", "load_datasets", "load_merge_config", "lopsided", "mixture_ratios", "resolve_merge_paths",
]
