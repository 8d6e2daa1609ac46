"""`opd route`: fit the router's text classifier, or show how a merge config routes a file.

    opd route fit --data labelled.jsonl --out configs/router.json
        fits on rows with `prompt` and `domain`, holds out a share to report accuracy,
        then refits on everything and saves the JSON file a `classifier` rule points at.
    opd route explain --config configs/merge_math_code.yaml --data prompts.jsonl
        prints each sample's teacher, the rule that decided and why, then the counts.
        Rows without `domain` get the domain `opd train` gives them: that of the config's
        data set (or eval set) whose file --data is, or --domain.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

from opd.config import number_arg, positive_int
from opd.data import load_jsonl
from opd.routing.classifier import fit
from opd.routing.merge import load_merge_config
from opd.routing.router import Router, RoutingError, preview


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="route_command", metavar="ACTION", required=True)
    fit_help = "fit the text classifier on a labelled prompt file (prompt + domain)"
    f = sub.add_parser("fit", help=fit_help, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=fit_help + ": holds out a share to report accuracy, then refits on every "
                                   "row and writes the JSON file a `classifier` routing rule points at")
    f.add_argument("--data", required=True, type=Path, help="JSONL with `prompt` and `domain` on every line")
    f.add_argument("--out", required=True, type=Path, help="classifier JSON to write (a classifier rule's `path`)")
    f.add_argument("--holdout", type=float, default=0.2, help="share held out to measure accuracy (0: none)")
    f.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    f.add_argument("--epochs", type=positive_int, default=150, help="full-batch optimizer steps")
    f.add_argument("--max-features", type=positive_int, default=20000,
                   help="most frequent n-gram/word features kept")
    explain_help = "print the route and reason of every sample of a file"
    e = sub.add_parser("explain", help=explain_help, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=explain_help + " as `opd train` routes it (rows without `domain` get the "
                                   "domain of the config's data set whose file --data is, or --domain), then "
                                   "the counts per rule and teacher")
    e.add_argument("--config", required=True, type=Path, help="merge config (or train config with `merge:`)")
    e.add_argument("--data", required=True, type=Path, help="JSONL prompts to route")
    e.add_argument("--domain", default=None,
                   help="domain of the rows without a `domain` field; None: the domain of the config's data set "
                        "or eval set whose file --data is (as `opd train` loads it), else none")
    e.add_argument("--limit", type=number_arg(int, 0, note=" (0: no limit)"), default=0,
                   help="print at most this many samples (0: all); counts cover all")
    e.add_argument("--json", action="store_true", help="one JSON object per sample instead of text")


def _fit(args) -> int:
    if not 0 <= args.holdout < 1:
        print(f"error: --holdout is the held-out share, 0 <= h < 1; got {args.holdout}", file=sys.stderr)
        return 2
    if args.out.is_dir():
        print(f"error: --out {args.out} is a directory; name the classifier file to write", file=sys.stderr)
        return 2
    samples, report = load_jsonl(args.data, on_error="stop")
    rows = [(s.prompt, s.domain) for s in samples if s.domain]
    if len(rows) < len(samples):
        print(f"error: {len(samples) - len(rows)} of {len(samples)} lines of {args.data} have no `domain`",
              file=sys.stderr)
        return 2
    random.Random(args.seed).shuffle(rows)
    n_hold = int(len(rows) * args.holdout)
    kw = dict(epochs=args.epochs, max_features=args.max_features)
    counts = Counter(y for _, y in rows)
    print(f"{len(rows)} prompts: " + ", ".join(f"{d} {n}" for d, n in sorted(counts.items())))
    accuracy = None
    try:   # too few prompts or domains to route between
        if n_hold > 0:
            held, train = rows[:n_hold], rows[n_hold:]
            clf = fit([x for x, _ in train], [y for _, y in train], **kw)
            accuracy = clf.accuracy([x for x, _ in held], [y for _, y in held])
            print(f"held-out accuracy: {accuracy:.4f} ({n_hold} prompts, fitted on {len(train)})")
        clf = fit([x for x, _ in rows], [y for _, y in rows], **kw)
    except ValueError as e:
        print(f"error: {args.data}: {e}", file=sys.stderr)
        return 2
    clf.meta.update({"data": str(args.data), "held_out_accuracy": accuracy, "held_out": n_hold})
    clf.save(args.out)
    print(f"wrote {args.out} ({len(clf.vocab)} features, labels {clf.labels})")
    return 0


def _explain(args) -> int:
    cfg = load_merge_config(args.config)
    router = Router(cfg.routing, cfg.teachers, base_dir=args.config.resolve().parent)
    default, why = _default_domain(cfg, args)
    if default is None and why.startswith("error: "):
        print(why, file=sys.stderr)
        return 2
    samples, _ = load_jsonl(args.data, on_error="stop", default_domain=default)
    failed = 0
    for i, s in enumerate(samples):
        show = not args.limit or i < args.limit
        try:
            r = router.route(s)
        except RoutingError as e:
            failed += 1
            if show:
                print(f"{i:5d}  UNROUTED  {e}")
            continue
        if not show:
            continue
        if args.json:
            print(json.dumps({"index": i, "prompt": s.prompt, "teacher": r.teacher, "weights": r.weights,
                              "rule": r.rule, "domain": r.domain, "reason": r.reason}))
        else:
            print(f"{i:5d}  {r.teacher:<10} {r.rule:<13} {preview(s.prompt, 40)!r:<44} {r.reason}")
    st = router.stats()
    out = sys.stderr if args.json else sys.stdout
    print(f"domain default: {why}", file=out)
    print(f"routed {len(samples) - failed} of {len(samples)}", file=out)
    print("by rule:    " + ", ".join(f"{k} {v}" for k, v in sorted(st["rule"].items())), file=out)
    print("by teacher: " + ", ".join(f"{k} {v}" for k, v in sorted(st["teacher"].items())), file=out)
    return 1 if failed else 0


def _default_domain(cfg, args) -> tuple[str | None, str]:
    """(the domain rows without one get, a line saying where it comes from). `opd train`
    loads each data set and eval set with its `domain` as the rows' default, so a file of the
    config is explained with that domain; "error: ..." when the file is two domains' set."""
    if args.domain is not None:
        if not args.domain.strip():
            return None, "error: --domain is empty; name a domain, or leave it out"
        return args.domain, f"{args.domain!r} for rows without `domain` (--domain)"
    data = args.data.resolve()
    found = {}   # domain -> the config key of the first set with this file
    for i, d in enumerate(cfg.datasets):
        for key, path in (("path", d.path), ("eval_path", d.eval_path)):
            if path and Path(path).resolve() == data:
                found.setdefault(d.domain, f"datasets[{i}].{key}")
    if len(found) > 1:
        sets = ", ".join(f"{k} (domain {dom!r})" for dom, k in found.items())
        return None, (f"error: {args.data} is the file of {sets}: `opd train` routes its rows once per set; "
                      f"pass --domain to explain one of them")
    if found:
        (domain, key), = found.items()
        return domain, (f"{domain!r} for rows without `domain` ({args.data} is the config's {key}, as `opd train` "
                        f"loads it)")
    return None, (f"none ({args.data} is none of the config's data sets or eval sets; --domain sets one for "
                  f"rows without `domain`)")


def run(args) -> int:
    return _fit(args) if args.route_command == "fit" else _explain(args)
