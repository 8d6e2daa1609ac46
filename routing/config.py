"""The merge config: which teachers exist, which samples go to which, and how losses combine.

The loss of a multi-teacher step is

    L = sum_d lambda_d * L_OPD^d  +  lambda_sft * L_SFT

where d runs over domains, L_OPD^d is the distillation loss of the samples routed to
domain d's teacher (with that teacher's temperature, beta, mode and k), and L_SFT the
cross-entropy on the general SFT set. A single-teacher run is a merge config with one
teacher and no rules (everything falls back to it).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from opd.config import field

Mode = Literal["topk", "student_topk", "full", "sampled"]


@dataclass(frozen=True)
class CrossSpec:
    """A teacher with another tokenizer (`tokenizer: cross`; opd.teachers.align, docs/teachers.md)."""
    tokenizer_path: str | None = field(None, help="the teacher's tokenizer (its model directory): the client tokenizes "
                                                  "the response and the teacher's prompt with it, and its fingerprint "
                                                  "must be the server's; default: this teacher's cluster.teachers model")
    match: Literal["prefix", "exact"] = field(
        "prefix", help="which teacher ids the exact part maps to a student id: exact: those whose text is a student "
                       "token; prefix: also the others, to the student's first token of their text (their mass is "
                       "the student's next token's: exact for a byte-level student)")
    exact: float = field(1.0, help="weight of the exact part: the divergence (beta) over the teacher's top-k ids "
                                   "mapped to student ids, plus one bucket", min=0.0)
    uld: float = field(1.0, help="weight of the ULD part: sorted-probability L1 over the ids the other side lacks",
                       min=0.0)
    span: float = field(1.0, help="weight of the sampled-token part: each aligned span's log-prob difference as a "
                                  "reverse-KL advantage", min=0.0)


@dataclass(frozen=True)
class TeacherSpec:
    name: str = field(help="teacher name, used in rules, metrics and the training card")
    address: str = field(help="ZeroMQ address of its `opd serve-teacher`, e.g. tcp://127.0.0.1:5555")
    replicas: list[str] = field(default_factory=list, help="more addresses serving the same teacher (same model "
                                                           "and tokenizer, checked): each request goes to the "
                                                           "least loaded, a dead one's to the others")
    domains: list[str] = field(default_factory=list, help="domains this teacher covers")
    mode: Mode = field("topk", help="topk: the teacher's top-k log-probs + tail bucket; student_topk: the "
                                    "teacher's log-probs at the student's own top k (at sampling) + tail bucket; "
                                    "full: full-vocabulary logits; sampled: sampled-token reverse KL as an advantage")
    k: int = field(32, help="top-k size (topk and student_topk modes)", min=1)
    context: str | None = field(None, help="what this teacher sees instead of the student's prompt: a template "
                                           "over the sample's fields, e.g. '{prompt}\\nReference answer: {answer}' "
                                           "(any JSONL key; {{ }} for a literal brace), rendered as the student's "
                                           "prompts are (chat template); it scores the student's response after it")
    temperature: float = field(1.0, help="divides both sides' logits before the softmax", min=1e-3)
    beta: float = field(0.0, help="divergence: 0 forward KL(teacher||student), 1 reverse KL(student||teacher), "
                                  "between: generalized JSD (sampled mode: always reverse KL)", min=0.0, max=1.0)
    scale_by_t2: bool = field(False, help="multiply this teacher's loss by temperature^2")
    weight: float = field(1.0, help="loss weight lambda of this teacher's samples", min=0.0)
    gamma: float = field(0.0, help="sampled mode: discount of the future tokens' reverse-KL terms folded into "
                                   "each token's advantage (0: each token its own term)", min=0.0, max=1.0)
    baseline: Literal["batch", "none"] = field(
        "batch", help="sampled mode: subtracted from each token's reverse-KL estimate before it is an advantage; "
                      "batch: the mean estimate over the batch's other sequences (unbiased, less noise); none: "
                      "nothing, the plain estimator")
    curve_server_key: str | None = field(None, help="server public key file when the teacher uses CURVE")
    tokenizer: Literal["same", "cross"] = field(
        "same", help="same: the student's tokenizer (checked at the handshake); cross: its own, the response "
                     "retokenized and its answers aligned back over text spans (mode topk; `cross` sets it up)")
    cross: CrossSpec = field(default_factory=CrossSpec, help="tokenizer: cross: the teacher's tokenizer and the "
                                                             "weights of the loss's three parts")

    def __post_init__(self):
        if self.tokenizer == "cross" and self.mode != "topk":
            raise ValueError(f"teacher {self.name!r}: tokenizer cross needs mode topk (its top k over its own "
                             f"vocabulary and its log-probs of its own tokens), got mode {self.mode}")
        if self.tokenizer == "cross" and not (self.cross.exact or self.cross.uld or self.cross.span):
            raise ValueError(f"teacher {self.name!r}: cross.exact, cross.uld and cross.span are all 0: nothing to train")
        if not self.address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"teacher {self.name!r}: address {self.address!r} needs its transport, "
                             f"e.g. tcp://127.0.0.1:5555 or ipc:///tmp/teacher.sock")
        if self.gamma and self.mode != "sampled":
            raise ValueError(f"teacher {self.name!r}: gamma discounts the sampled-token advantage; mode "
                             f"{self.mode} computes an exact divergence per position: remove gamma or use mode sampled")
        if self.context is not None:
            try:   # the template's fields, checked here rather than at the first batch
                names = [f for _, f, _, _ in string.Formatter().parse(self.context) if f is not None]
            except ValueError as e:
                raise ValueError(f"teacher {self.name!r}: context {self.context!r} is no template ({e}); "
                                 f"write a literal brace as {{{{ or }}}}") from None
            bad = [f for f in names if not f.isidentifier()]
            if bad or not self.context.strip():
                raise ValueError(f"teacher {self.name!r}: context needs text and plain field names like "
                                 f"{{prompt}} or {{answer}}, got {self.context!r}")
        if self.mode == "sampled" and 0 < self.beta < 1:
            raise ValueError(f"teacher {self.name!r}: mode sampled trains reverse KL (the sampled-token estimate); "
                             f"beta {self.beta} would not be used: remove it, or use mode topk or full for a JSD")

    @property
    def divergence_beta(self) -> float:
        """The beta this teacher's loss follows: sampled mode is reverse KL whatever `beta` says."""
        return 1.0 if self.mode == "sampled" else self.beta


@dataclass(frozen=True)
class RuleSpec:
    kind: Literal["domain_field", "pattern", "keywords", "classifier", "fallback"] = field(
        help="domain_field: the sample's `domain`; pattern: regex on the prompt; keywords: any keyword in the "
             "prompt; classifier: trained text classifier; fallback: always matches")
    teacher: str | None = field(None, help="teacher chosen when the rule matches (pattern/keywords/fallback)")
    domain: str | None = field(None, help="instead of `teacher`: the domain assigned when the rule matches; its "
                                          "teachers are chosen (and weighted by pass rate if asked)")
    patterns: list[str] = field(default_factory=list, help="regular expressions (pattern rule)")
    keywords: list[str] = field(default_factory=list, help="keywords, case-insensitive (keywords rule)")
    path: str | None = field(None, help="classifier file written by `opd route fit` (classifier rule), "
                                        "relative to the config file")
    min_confidence: float = field(0.0, help="classifier rule: below this probability the rule abstains",
                                  min=0.0, max=1.0)


@dataclass(frozen=True)
class RouterConfig:
    rules: list[RuleSpec] = field(default_factory=list, help="tried in order; the first that decides wins")
    weighting: Literal["single", "pass_rate"] = field(
        "single", help="single: one teacher per sample; pass_rate: weight the teachers covering a domain by "
                       "their measured pass rate on it")
    pass_rates: dict[str, dict[str, float]] = field(
        default_factory=dict, help="{domain: {teacher: pass rate}} measured beforehand, e.g. by `opd validate`; "
                                   "with refresh_every, the weights until the run's first measurement")
    refresh_every: int = field(0, help="pass_rate weighting, opd train: measure each teacher's pass rate on every "
                                       "domain two or more teachers cover, before the first step and every this "
                                       "many steps (the teachers answer held-out prompts, SAMPLE, and the "
                                       "verifier scores them; the rates pool every measurement so far); 0: the "
                                       "pass_rates above for the whole run", min=0)
    refresh_prompts: int = field(16, help="held-out prompts per domain each teacher answers per measurement (the "
                                          "next ones of the domain's eval_path, in turn)", min=1)


@dataclass(frozen=True)
class DatasetSpec:
    domain: str = field(help="domain of every sample in the file (a sample's own `domain` field wins)")
    path: str = field(help="JSONL prompts (relative to the config file)")
    ratio: float = field(1.0, help="mixture ratio: share of each batch drawn from this set (normalized)", min=0.0)
    eval_path: str | None = field(None, help="held-out JSONL for evaluation (KL, accuracy)")


@dataclass(frozen=True)
class SFTSpec:
    path: str = field(help="JSONL with `prompt` and `response` (general instruction data)")
    lambda_sft: float = field(0.1, help="weight of the SFT cross-entropy added to the distillation loss", min=0.0)
    batch_size: int = field(4, help="SFT samples per step", min=1)


@dataclass(frozen=True)
class MergeConfig:
    teachers: list[TeacherSpec] = field(help="every teacher of the merge")
    datasets: list[DatasetSpec] = field(help="prompt sets per domain with mixture ratios")
    routing: RouterConfig = field(default_factory=RouterConfig, help="how a sample finds its teacher")
    sft: SFTSpec | None = field(None, help="general SFT mix (the cheap insurance against forgetting)")
    domain_weights: dict[str, float] = field(default_factory=dict, help="lambda_d per domain (default 1)")
    normalize: Literal["none", "running_mean"] = field(
        "none", help="running_mean: divide each domain's loss by its running mean so no domain takes over")
    normalize_momentum: float = field(0.9, help="EMA momentum of the running mean", min=0.0, max=0.9999)

    def __post_init__(self):
        names = [t.name for t in self.teachers]
        if not names:
            raise ValueError("at least one teacher is required")
        if len(set(names)) != len(names):
            raise ValueError(f"teacher names must be unique, got {names}")
        for r in self.routing.rules:
            if r.teacher is not None and r.teacher not in names:
                raise ValueError(f"rule {r.kind!r} names teacher {r.teacher!r}, which is not among {names}")
        if self.routing.refresh_every and self.routing.weighting != "pass_rate":
            raise ValueError(f"routing.refresh_every ({self.routing.refresh_every}) measures the pass rates that "
                             f"weighting: pass_rate weighs teachers by; set weighting: pass_rate, or remove it")
        for domain, rates in self.routing.pass_rates.items():
            unknown = [t for t in rates if t not in names]
            if unknown:
                raise ValueError(f"routing.pass_rates[{domain!r}] names {unknown}, which are not among {names}")
            # -0.5 and 1.0 became weights -1 and 2: the second teacher's samples weighed double.
            bad = {t: r for t, r in rates.items() if not 0.0 <= r <= 1.0}
            if bad:
                raise ValueError(f"routing.pass_rates[{domain!r}]: pass rates are shares of problems solved, in "
                                 f"[0, 1]; got {bad}")
        domains = [d.domain for d in self.datasets]
        if not domains:
            raise ValueError("datasets: at least one prompt set is required")
        if len(set(domains)) != len(domains):
            # The sampler draws per domain with one ratio each: a second set of a domain would
            # silently replace the first one's ratio.
            raise ValueError(f"datasets: one prompt set per domain (put a domain's prompts in one file, or give "
                             f"each set its own domain), got {domains}")
        if not any(d.ratio > 0 for d in self.datasets):
            raise ValueError("datasets: every ratio is 0; at least one prompt set must be drawn from")

    def teacher(self, name: str) -> TeacherSpec:
        return next(t for t in self.teachers if t.name == name)


@dataclass(frozen=True)
class TeacherClientSettings:
    connect_timeout_s: float = field(10.0, help="at start: seconds to wait for each teacher's WELCOME before "
                                                "refusing to train", min=0.1)
    timeout_s: float = field(60.0, help="seconds to wait for one teacher answer before retrying", min=0.1)
    retries: int = field(3, help="retries of a failed or timed-out request (BUSY answers are retried for "
                                 "timeout_s instead)", min=0)
    backoff_s: float = field(0.2, help="first retry delay (doubles each retry)", min=0.0)
    curve_secret_key: str | None = field(None, help="client .key_secret file (`opd keys generate`) for teachers "
                                                    "with merge.teachers[].curve_server_key; its public key must "
                                                    "be on the servers' --curve-allow list")
