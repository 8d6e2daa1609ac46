"""Loading a merge config: paths resolved against the config file, data sets per domain.

A merge config is either a file of its own (the keys of MergeConfig at the top level) or
the `merge:` section of an `opd train` config; `load_merge_config` reads both. Relative
paths (data sets, SFT set, classifier files) are relative to the config file's folder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from opd.config import ConfigError, load_yaml, near
from opd.data import Sample, load_jsonl
from opd.routing.config import MergeConfig


def resolve_merge_paths(cfg: MergeConfig, base_dir: str | Path) -> MergeConfig:
    """Every relative path of `cfg` (data sets, eval sets, SFT set, classifier files) made
    relative to `base_dir`. Absolute paths are kept, so resolving twice changes nothing."""
    base = Path(base_dir)
    routing = replace(cfg.routing, rules=[replace(r, path=near(base, r.path)) for r in cfg.routing.rules])
    return replace(
        cfg,
        datasets=[replace(d, path=near(base, d.path), eval_path=near(base, d.eval_path)) for d in cfg.datasets],
        sft=replace(cfg.sft, path=near(base, cfg.sft.path)) if cfg.sft else None,
        routing=routing,
    )


def load_merge_config(path: str | Path) -> MergeConfig:
    """A MergeConfig from a merge file or from the `merge:` section of a train config."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        top = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    # A train config's `merge:` section is checked as a merge config, with file:line errors.
    section = "merge" if isinstance(top, dict) and "merge" in top and "teachers" not in top else None
    cfg = load_yaml(p, MergeConfig, section=section)
    return resolve_merge_paths(cfg, p.resolve().parent)


def load_datasets(cfg: MergeConfig, *, split: str = "train", on_error: str = "stop") -> dict[str, list[Sample]]:
    """{domain: samples} of the config's train (or "eval") sets; a sample's own `domain` wins
    over the set's. Two sets of the same domain are concatenated."""
    out: dict[str, list[Sample]] = {}
    for spec in cfg.datasets:
        path = spec.path if split == "train" else spec.eval_path
        if path is None:
            continue
        samples, _ = load_jsonl(path, on_error=on_error, default_domain=spec.domain)
        out.setdefault(spec.domain, []).extend(samples)
    return out


def mixture_ratios(cfg: MergeConfig) -> dict[str, float]:
    """Mixture ratio per domain (summed over that domain's data sets)."""
    ratios: dict[str, float] = {}
    for spec in cfg.datasets:
        ratios[spec.domain] = ratios.get(spec.domain, 0.0) + spec.ratio
    return ratios
