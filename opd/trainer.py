"""The on-policy distillation loop, top to bottom.

One optimizer step (`Trainer.run`):
  1. take a batch of prompts (mixture of the domains' prompt sets) and route each to its teacher;
  2. the student samples responses with its current weights (rollout engine);
  3. each teacher scores the responses routed to it (top-k, full vocabulary or sampled token),
     after trimming positions past the answer's end;
  4. the loss from opd.kernels on response rows only (prompt and padding masked), per-domain
     weights, optional SFT cross-entropy; backward in micro-batches. The first micro-batch's
     student forward runs before waiting for step 3: the teachers score in their own
     processes meanwhile;
  5. one optimizer step on the student (the teachers never change), then the rollout engine
     receives the new weights.
With `run.pipeline`, step 2 and 3 of the NEXT batch happen before step 4 of the current one,
so the teachers score while the student trains; that batch's rollouts then come from weights
one optimizer step old (staleness 1, recorded per step and in the card). Without it every
batch is sampled from the current weights (staleness 0).

Deviation from the textbook: with `merge.normalize: running_mean`, a domain's multiplier is
its running mean loss up to the previous step (the current step's loss is only known after
its backward); the first step uses 1.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from opd import distill
from opd.checkpoint import (claim_run_dir, latest_checkpoint, load_checkpoint, resume_changes, rng_state,
                            save_checkpoint, save_final_model, set_rng_state)
from opd.config import to_dict
from opd.data import Cycler, Sample, encode_prompt, load_jsonl
from opd.diagnostics import DomainTally, topk_overlap
from opd.lm_head import FUSED_REFUSED, head_form
from opd.lora import add_lora
from opd.metrics import MetricsLogger, plot_metrics
from opd.rollout.base import Rollout, SamplingParams, eos_ids
from opd.train_card import write_train_card
from opd.train_config import TrainConfig
from opd.train_launch import RunTeachers
from opd.train_teachers import Answer, TeacherSet, TrainError

__all__ = ["Batch", "Route", "Trainer", "TrainError"]

MAX_NONFINITE_IN_A_ROW = 3   # steps skipped for a NaN/inf gradient before the run stops

# Config keys a resumed run must share with its checkpoint (opd.checkpoint.resume_changes):
# they define the objective, so another value would make the card's one description of the
# run false for the steps before the resume. Other keys (steps, lr, evaluation, where the
# teachers listen, ...) may change and are listed in the card.
RESUME_FIXED = ("student.path", "student.dtype", "student.lora", "student.lora.*", "merge.teachers.*",
                "merge.datasets", "merge.routing.*", "merge.sft", "merge.sft.*", "merge.domain_weights*",
                "merge.normalize*", "loss.*", "rollout.temperature", "rollout.top_p", "rollout.samples_per_prompt",
                "rollout.prompts_per_step", "rollout.max_new_tokens", "run.seed")
RESUME_FREE = ("merge.teachers.*.address", "merge.teachers.*.curve_server_key", "loss.impl", "loss.fused_linear")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- the pieces a step needs ------------------------------------------------------------

@dataclass
class Route:
    """Where a sample goes: teacher weights (sum 1), its domain for metrics, and why."""
    weights: dict[str, float]
    domain: str
    rule: str = ""
    reason: str = ""


@dataclass
class Batch:
    index: int                      # batches drawn so far (the data position)
    samples: list[Sample]
    routes: list[Route]             # per prompt
    rollouts: list[Rollout]         # per sequence, samples_per_prompt per prompt
    keep: list[int]                 # trimmed response length per sequence
    policy_version: int             # optimizer steps the sampling weights had taken
    futures: dict[str, Future] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)  # teacher -> sequences it scores

    def route_of(self, seq: int) -> Route:
        return self.routes[self.rollouts[seq].prompt_index]

    def to_state(self) -> dict:
        return {"index": self.index, "policy_version": self.policy_version, "keep": self.keep,
                "samples": [asdict(s) for s in self.samples], "routes": [asdict(r) for r in self.routes],
                "rollouts": [asdict(r) for r in self.rollouts]}

    @staticmethod
    def from_state(d: dict) -> "Batch":
        return Batch(index=d["index"], samples=[Sample(**s) for s in d["samples"]],
                     routes=[Route(**r) for r in d["routes"]], rollouts=[Rollout(**r) for r in d["rollouts"]],
                     keep=list(d["keep"]), policy_version=d["policy_version"])


def load_tokenizer(cfg):
    from opd.fingerprint import load_model_tokenizer

    tokenizer = load_model_tokenizer(cfg.path, "student.path")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_student(cfg, seed: int, tokenizer=None):
    """(model, tokenizer): full fine-tuning or a fresh peft LoRA adapter, in train mode.
    tokenizer: one already loaded by load_tokenizer(cfg), else it is loaded here."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or load_tokenizer(cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=TORCH_DTYPES[cfg.dtype]).to(cfg.device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.lora is not None:
        model = add_lora(model, cfg.lora, cfg.path)
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    model.train()
    return model, tokenizer


def lr_lambda(optim, steps: int):
    def f(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, steps - optim.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1 - progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape
    return f


# ---- the trainer ------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: str | Path | bool | None = None, base_dir: str | Path = ".",
                 fork_teachers: bool = False, overwrite: bool = False):
        """overwrite: a fresh run may replace an earlier run in run.out_dir (else it is
        refused; opd.checkpoint.claim_run_dir). fork_teachers: with cluster.mode fork, fork the
        teacher servers from this process (what `opd train` does, before it computes
        anything); False starts them as subprocesses, which
        a process that may already have run torch (a notebook, a test) needs: a forked child
        hangs in the OpenMP thread pool its parent used."""
        self.cfg = cfg
        self.out = Path(cfg.run.out_dir)
        self.launched = RunTeachers(self.out, fork=fork_teachers)   # what cluster.mode starts
        self.base_dir = Path(base_dir)
        self.resume = resume
        self.overwrite = overwrite
        self.version = 0          # optimizer steps taken
        self.nonfinite_in_a_row = 0   # steps skipped for a NaN/inf gradient, in a row
        self.step = 0
        self.batches = 0          # batches drawn
        self.staleness: list[int] = []
        self.teacher_samples: dict[str, float] = {t.name: 0.0 for t in cfg.merge.teachers}
        self.tail_mass: dict[str, list[float]] = {t.name: [0.0, 0] for t in cfg.merge.teachers}  # [sum, rows]
        self.warnings: list[str] = []
        self.trimmed = [0, 0]   # [response tokens trimmed after the answer, response tokens sampled]
        self.evals: list[dict] = []

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        from opd.fingerprint import model_fingerprint, tokenizer_fingerprint

        cfg = self.cfg
        claim_run_dir(self.out, resume=bool(self.resume), overwrite=self.overwrite)
        self.resume_from = self._resume_checkpoint()
        self.specs = {t.name: t for t in cfg.merge.teachers}
        # Teachers are checked (reachable, same tokenizer) before the student is even loaded.
        tokenizer = load_tokenizer(cfg.student)
        self.student_fp = tokenizer_fingerprint(tokenizer)
        self.cfg = cfg = self.launched.start(cfg)
        self.teachers = TeacherSet(cfg, self.student_fp, cfg.student.path, self.launched.cluster)
        for note in [self.teachers.memory_note, *self.teachers.vocab_notes]:
            if note:
                print(f"warning: {note}", flush=True)
                self.warnings.append(note)
        torch.manual_seed(cfg.run.seed)
        self.model, self.tok = load_student(cfg.student, cfg.run.seed, tokenizer)
        if cfg.loss.fused_linear and not head_form(self.model).fusable:
            raise TrainError(f"loss.fused_linear: student {cfg.student.path}: {FUSED_REFUSED}")
        self.student_model_fp = model_fingerprint(cfg.student.path)
        self._load_data()
        self.stop_ids = eos_ids(self.tok, getattr(self.model, "generation_config", None))
        params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, cfg.run.steps))
        from opd.routing.normalize import DomainLossNormalizer

        self.normalizer = DomainLossNormalizer(cfg.merge.normalize, cfg.merge.normalize_momentum)
        self.multipliers: dict[str, float] = {}
        self.pending: Batch | None = None
        resume_step = self._maybe_resume()
        self.engine = self._make_engine()
        self.metrics = MetricsLogger(self.out, tensorboard=cfg.run.tensorboard, resume_step=resume_step)
        self.verify = _verifier()

    def _load_data(self) -> None:
        """Load every prompt file, route each prompt once (a prompt no rule decides is found here,
        not when its batch comes), and keep the prompts that fit their teachers (`_fit_length`)."""
        from opd.routing.mixture import MixtureSampler
        from opd.routing.router import RoutingError

        cfg = self.cfg
        files: list[tuple[str, str, list[Sample], bool]] = []   # (domain, path, samples, held out)
        self.data_reports = {}
        for d in cfg.merge.datasets:
            for path, held_out in ((d.path, False), (d.eval_path, True)):
                if path:
                    samples, self.data_reports[path] = load_jsonl(path, on_error=cfg.run.on_data_error,
                                                                  default_domain=d.domain)
                    files.append((d.domain, path, samples, held_out))
        self._make_router({s.domain for *_, samples, _ in files for s in samples if s.domain})
        self.routes: dict[int, Route] = {}   # id(sample) -> its route, for every sample kept
        self.datasets: dict[str, list[Sample]] = {}
        self.eval_sets: dict[str, list[Sample]] = {}
        self.length_limits = self._length_limits()
        for domain, path, samples, held_out in files:
            try:
                routes = [self._route(s) for s in samples]
            except RoutingError as e:
                raise TrainError(f"{path}: {e}") from None
            kept = self._fit_length(samples, routes, path)
            (self.eval_sets if held_out else self.datasets).setdefault(domain, []).extend(kept)
        self.sampler = MixtureSampler(self.datasets, {d.domain: d.ratio for d in cfg.merge.datasets}, seed=cfg.run.seed)
        self.sft = None
        if cfg.merge.sft is not None:
            sft, report = load_jsonl(cfg.merge.sft.path, on_error=cfg.run.on_data_error)
            self.data_reports[cfg.merge.sft.path] = report
            missing = [i for i, s in enumerate(sft) if not s.response]
            if missing:
                raise TrainError(f"{cfg.merge.sft.path}: SFT samples need a `response` (sample {missing[0] + 1} has none)")
            self.sft = Cycler(sft, seed=cfg.run.seed + 1)
        for path, report in self.data_reports.items():  # run.on_data_error: skip; said once, kept in the card
            if report.skipped:
                print(f"{path}: skipped {report.skipped} malformed lines (first: {report.errors[0]})", flush=True)
        # Held-out prompts: round-robin over domains.
        pools = [list(v) for v in self.eval_sets.values()]
        picked: list[Sample] = []
        while len(picked) < cfg.run.eval_prompts and any(pools):
            for p in pools:
                if p and len(picked) < cfg.run.eval_prompts:
                    picked.append(p.pop(0))
        self.eval_samples = picked
        self.eval_routes = [self.routes[id(s)] for s in picked]

    def _length_limits(self) -> tuple[int, dict[str, int]]:
        """(positions the student takes, {teacher: positions it takes}); 0 or left out: not said
        (a 2.0 server)."""
        teachers = {t: self.teachers.welcome(t).max_positions for t in self.specs}
        student = getattr(self.model.config, "max_position_embeddings", 0) or 0
        return student, {t: n for t, n in teachers.items() if n > 0}

    def _fit_length(self, samples: list[Sample], routes: list[Route], path: str) -> list[Sample]:
        """The samples whose prompt leaves room for rollout.max_new_tokens within the positions
        of the student and of the teachers the sample is routed to, each with its route kept in
        `self.routes`. A longer one would get TOO_LONG from its teacher when its batch comes,
        hours into a run: refused here (run.on_data_error: stop), or dropped and said in the
        card (skip)."""
        student, teachers = self.length_limits

        def limit(route: Route) -> tuple[str, int] | None:
            """(who, positions): the smallest limit this sample meets, None when none is said."""
            named = {f"teacher {t!r}": n for t, n in teachers.items() if t in route.weights}
            if student:
                named["the student"] = student
            return min(named.items(), key=lambda kv: kv[1]) if named else None

        new = self.cfg.rollout.max_new_tokens
        limits = [limit(r) for r in routes]
        lengths = [len(encode_prompt(self.tok, s.prompt)) if lim else 0 for s, lim in zip(samples, limits)]
        long = [i for i, (n, lim) in enumerate(zip(lengths, limits)) if lim and n > lim[1] - new]
        if long:
            who, n = limits[long[0]]
            msg = (f"{path}: {len(long)} of {len(samples)} prompts leave no room for rollout.max_new_tokens ({new}) "
                   f"within the positions their teacher or the student takes (first: "
                   f"{samples[long[0]].prompt[:60]!r}, {lengths[long[0]]} tokens; {who} takes {n})")
            if len(long) == len(samples):
                raise TrainError(f"{msg}: no prompt of the file fits; shorten them or lower rollout.max_new_tokens")
            if self.cfg.run.on_data_error == "stop":
                raise TrainError(f"{msg}; shorten them, lower rollout.max_new_tokens, or set run.on_data_error: "
                                 f"skip to leave them out")
            print(f"warning: {msg}; left out (run.on_data_error: skip)", flush=True)
            self.warnings.append(f"{msg}; left out")
        drop = set(long)
        kept = [(s, r) for i, (s, r) in enumerate(zip(samples, routes)) if i not in drop]
        self.routes.update((id(s), r) for s, r in kept)   # kept samples live for the run: their ids stay theirs
        return [s for s, _ in kept]

    def _make_router(self, sample_domains: set[str]) -> None:
        from opd.routing.router import Router

        merge = self.cfg.merge
        # A misspelt domain in these maps would silently weigh nothing: name the run's domains.
        known = ({d.domain for d in merge.datasets} | {r.domain for r in merge.routing.rules if r.domain}
                 | sample_domains | {d for t in merge.teachers for d in t.domains} | {t.name for t in merge.teachers})
        for key, mapping in (("merge.domain_weights", merge.domain_weights),
                             ("merge.routing.pass_rates", merge.routing.pass_rates)):
            unknown = sorted(set(mapping) - known)
            if unknown:
                raise TrainError(f"{key}: {unknown} is not a domain of this run (its domains: {sorted(known)})")
        self.router = Router(merge.routing, merge.teachers, self.base_dir)

    def _route(self, sample: Sample) -> Route:
        r = self.router.route(sample)
        return Route(weights={t: float(w) for t, w in r.weights.items() if w > 0},
                     domain=r.domain or sample.domain or r.teacher, rule=r.rule, reason=r.reason)

    def _make_engine(self):
        cfg = self.cfg
        if cfg.rollout.engine == "vllm":
            from opd.rollout.vllm import VLLMRolloutEngine

            lora = {"rank": cfg.student.lora.rank} if cfg.student.lora else None
            engine = VLLMRolloutEngine(cfg.student.path, lora=lora, seed=cfg.run.seed, dtype=cfg.student.dtype,
                                       max_model_len=cfg.rollout.vllm_max_model_len,
                                       gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization)
            engine.sync_weights(self.model)  # a resumed or LoRA student differs from the directory
            return engine
        from opd.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(self.model, self.tok, batch_size=cfg.rollout.batch_size)

    def _resume_checkpoint(self) -> Path | None:
        """The checkpoint --resume continues, its config checked against this one before anything
        loads: a key that defines the objective must be the same (RESUME_FIXED), the others
        changed are said in the card."""
        if not self.resume:
            return None
        ckpt = Path(self.resume) if not isinstance(self.resume, bool) else latest_checkpoint(self.out / "checkpoints")
        if ckpt is not None and ckpt.name == "checkpoints":
            ckpt = latest_checkpoint(ckpt)
        if ckpt is None or not (ckpt / "state.json").is_file():
            raise TrainError(f"--resume: no complete checkpoint under {self.out / 'checkpoints'}")
        saved = json.loads((ckpt / "state.json").read_text()).get("config")
        changed = resume_changes(saved, to_dict(self.cfg), RESUME_FIXED, RESUME_FREE)
        if changed:
            self.warnings.append(f"resumed from {ckpt.name}; changed since that checkpoint: {', '.join(changed)}")
        return ckpt

    def _maybe_resume(self) -> int | None:
        ckpt = self.resume_from
        if ckpt is None:
            return None
        state = load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        # The optimizer comes back with the rate the checkpointed run's schedule set for its
        # next step. With another run.steps (`--resume --steps N`) the schedule is another one:
        # its rate at this step, or a finished cosine run's extension starts at lr 0.
        at = lr_lambda(self.cfg.optim, self.cfg.run.steps)(self.scheduler.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * at
        self.step = state["step"]
        self.version = state.get("version", self.step)   # fewer than steps when a step was skipped
        self.trimmed = list(state.get("trimmed", [0, 0]))
        self.batches = state["batches"]
        self.sampler.load_state(state["sampler"])
        if self.sft is not None and state.get("sft") is not None:
            self.sft.load_state(state["sft"])
        self.normalizer.load_state(state["normalizer"])
        self.multipliers = state["multipliers"]
        self.staleness = state["staleness"]
        self.teacher_samples = state["teacher_samples"]
        self.tail_mass = {k: list(v) for k, v in state["tail_mass"].items()}
        # The card's history: evaluations (its first held-out KL is the one before training)
        # and warnings from before the resume, then this session's not already there.
        self.evals = state["evals"]
        self.warnings = state["warnings"] + [w for w in self.warnings if w not in state["warnings"]]
        if state.get("pending"):
            self.pending = Batch.from_state(state["pending"])
        print(f"resumed from {ckpt} at step {self.step}", flush=True)
        return self.step

    # -- 1-3: a batch, its rollouts, the teachers' answers ----------------------------------
    def _sample_batch(self) -> Batch:
        r = self.cfg.rollout
        samples = self.sampler.sample(r.prompts_per_step)
        routes = [self.routes[id(s)] for s in samples]
        prompts = [encode_prompt(self.tok, s.prompt) for s in samples]
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                n=r.samples_per_prompt, seed=self.cfg.run.seed * 1_000_003 + self.batches)
        rollouts = self.engine.generate(prompts, params)
        batch = Batch(index=self.batches, samples=samples, routes=routes, rollouts=rollouts,
                      keep=[self._trim(ro.response_ids) for ro in rollouts], policy_version=self.version)
        self.batches += 1
        return batch

    def _trim(self, response: list[int]) -> int:
        loss = self.cfg.loss
        return distill.trim_length(response, eos_ids=self.stop_ids, trim=loss.trim,
                                   marker=loss.answer_end_marker, tokenizer=self.tok)

    def _submit(self, batch: Batch) -> Batch:
        """Send every teacher the sequences routed to it (prompt + trimmed response)."""
        batch.members = {}
        for seq in range(len(batch.rollouts)):
            for t in batch.route_of(seq).weights:
                batch.members.setdefault(t, []).append(seq)
        for t, seqs in batch.members.items():
            ros = [batch.rollouts[i] for i in seqs]
            sequences = [ro.prompt_ids + ro.response_ids[:batch.keep[i]] for ro, i in zip(ros, seqs)]
            starts = [len(ro.prompt_ids) for ro in ros]
            batch.futures[t] = self.teachers.request(t, sequences, starts)
        return batch

    # -- 4: the loss ------------------------------------------------------------------------
    def _loss_rows(self, spec, rows, answer: Answer, idx: torch.Tensor, targets: torch.Tensor):
        """(loss rows with grad, KL rows for metrics) of one teacher on selected answer rows."""
        from opd.kernels import distill_loss, fused_linear_distill_loss, sampled_token_reverse_kl

        impl = self.cfg.loss.impl
        t2 = spec.temperature ** 2 if spec.scale_by_t2 else 1.0
        if spec.mode == "sampled":
            logits = rows if not isinstance(rows, tuple) else rows[0] @ rows[1].T
            student_lp = torch.log_softmax(logits.float() / spec.temperature, -1).gather(
                -1, targets[:, None].to(logits.device)).squeeze(-1)
            est = sampled_token_reverse_kl(student_lp, answer.token_logprob[idx].to(student_lp.device))
            # Policy gradient with advantage -est: d/dθ of est * log p_student(x).
            return est * student_lp * t2, est
        if spec.mode == "full":
            teacher = distill.take_rows(answer.logits, idx).float()
        else:
            t = answer.topk
            teacher = type(t)(*(distill.take_rows(x, idx) for x in t))
        if isinstance(rows, tuple):
            hidden, weight = rows
            teacher = teacher.to(hidden.device) if isinstance(teacher, torch.Tensor) else type(teacher)(
                *(x.to(hidden.device) for x in teacher))
            if isinstance(teacher, torch.Tensor) and teacher.shape[1] != weight.shape[0]:
                raise TrainError(f"teacher vocabulary {teacher.shape[1]} != student LM head {weight.shape[0]}")
            kl = fused_linear_distill_loss(hidden, weight, teacher, beta=spec.beta, temperature=spec.temperature,
                                           reduction="none", impl=impl)
        else:
            teacher = teacher.to(rows.device) if isinstance(teacher, torch.Tensor) else type(teacher)(
                *(x.to(rows.device) for x in teacher))
            if isinstance(teacher, torch.Tensor) and teacher.shape[1] != rows.shape[1]:
                v = min(teacher.shape[1], rows.shape[1])
                teacher, rows = teacher[:, :v], rows[:, :v]
            kl = distill_loss(rows, teacher, beta=spec.beta, temperature=spec.temperature, reduction="none",
                              impl=impl)
        return kl * t2, kl.detach()

    def _wait_answers(self, batch: Batch, sums: dict) -> dict[str, Answer]:
        t0 = time.perf_counter()
        answers = self.teachers.answers(batch.futures)
        sums["wait_s"] += time.perf_counter() - t0
        return answers

    def _train_batch(self, batch: Batch, scale: float, tally: DomainTally, sums: dict) -> dict:
        cfg = self.cfg
        n_seq = len(batch.rollouts)
        for seq, ro in enumerate(batch.rollouts):
            tally.add_response(batch.route_of(seq).domain, ro.response_ids, ro.finish_reason)
        responses = [ro.response_ids[:k] for ro, k in zip(batch.rollouts, batch.keep)]
        offsets = [0]
        for r in responses:
            offsets.append(offsets[-1] + len(r))
        domains = [batch.route_of(s).domain for s in range(n_seq)]
        lam = {d: cfg.merge.domain_weights.get(d, 1.0) * self.multipliers.get(d, 1.0) for d in set(domains)}
        weights_N = distill.row_weights(offsets, domains, lam, cfg.loss.length_norm) * scale
        answers: dict[str, Answer] | None = None
        domain_loss: dict[str, float] = {}
        total = 0.0
        mb = cfg.optim.micro_batch_size
        for a in range(0, n_seq, mb):
            seqs = list(range(a, min(a + mb, n_seq)))
            packed = distill.pack([batch.rollouts[s].prompt_ids for s in seqs], [responses[s] for s in seqs],
                                  self.tok.pad_token_id)
            if packed.row_offsets[-1] == 0:
                continue
            rows = distill.student_rows(self.model, packed, fused=cfg.loss.fused_linear)
            if answers is None:
                # The first micro-batch's forward ran while the teachers scored (they work in
                # their own processes); only now does the student need their answers.
                answers = self._wait_answers(batch, sums)
                # Where each sequence's rows sit in each teacher's answer.
                where = {t: {seq: answers[t].row_offsets[j] for j, seq in enumerate(members)}
                         for t, members in batch.members.items()}
            device = rows[0].device if isinstance(rows, tuple) else rows.device
            loss = torch.zeros((), device=device)
            logits_for_diag = None
            for t in batch.members:
                spec = self.specs[t]
                local, remote, w_rows, row_domain = [], [], [], []
                for j, s in enumerate(seqs):
                    w = batch.route_of(s).weights.get(t, 0.0)
                    if w <= 0 or s not in where[t]:
                        continue
                    n = len(responses[s])
                    local.extend(range(packed.row_offsets[j], packed.row_offsets[j] + n))
                    remote.extend(range(where[t][s], where[t][s] + n))
                    w_rows.append(weights_N[offsets[s]:offsets[s] + n] * w * spec.weight)
                    row_domain += [domains[s]] * n
                if not local:
                    continue
                local_i, remote_i = torch.tensor(local), torch.tensor(remote)
                sel = distill.select_rows(rows, local_i.to(device))
                loss_rows, kl_rows = self._loss_rows(spec, sel, answers[t], remote_i, packed.targets_N[local_i])
                weighted = torch.cat(w_rows).to(device) * loss_rows
                loss = loss + weighted.sum()
                # Diagnostics per domain, from the same rows.
                contrib, kl_cpu = weighted.detach().cpu(), kl_rows.cpu()
                if logits_for_diag is None:
                    logits_for_diag = distill.rows_logits(rows)
                overlap = topk_overlap(logits_for_diag[local_i.to(logits_for_diag.device)],
                                       self.teachers.topk_ids(spec, answers[t], remote_i))
                tail = answers[t].topk.tail_logmass[remote_i].exp() if answers[t].topk is not None else None
                if tail is not None:
                    self.tail_mass[t][0] += float(tail.sum())
                    self.tail_mass[t][1] += len(tail)
                for d in sorted(set(row_domain)):
                    m = torch.tensor([x == d for x in row_domain])
                    tally.add_rows(d, "kl", kl_cpu[m])
                    tally.add_rows(d, "topk_overlap", overlap[m])
                    if tail is not None:
                        tally.add_rows(d, "teacher_tail_mass", tail[m])
                    part = float(contrib[m].sum())
                    domain_loss[d] = domain_loss.get(d, 0.0) + part / max(lam[d], 1e-12)
                    tally.add_loss(d, part)
            loss.backward()
            total += float(loss.detach())
        if answers is None:  # every response trimmed to nothing: still collect the answers
            answers = self._wait_answers(batch, sums)
        sums["wait_s"] += self.teachers.finish(answers)   # full mode: time blocked on streamed rows
        return {"loss": total, "domain_loss": domain_loss, "answers": answers}

    def _sft_step(self, scale: float) -> float | None:
        if self.sft is None:
            return None
        spec = self.cfg.merge.sft
        samples = self.sft.take(spec.batch_size)
        prompts = [encode_prompt(self.tok, s.prompt) for s in samples]
        eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
        responses = [self.tok(s.response, add_special_tokens=False)["input_ids"] + eos for s in samples]
        ce = distill.sft_loss(self.model, prompts, responses, self.tok.pad_token_id)
        (spec.lambda_sft * scale * ce).backward()
        return float(ce.detach())

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self.setup()
            return self._loop()
        finally:
            self.close()

    def _loop(self) -> dict:
        cfg = self.cfg
        from tqdm import tqdm

        if self.step == 0:
            self._evaluate()
        accum = cfg.optim.grad_accum
        last_batch = cfg.run.steps * accum
        if self.pending is not None:
            self._submit(self.pending)
        bar = tqdm(total=cfg.run.steps, initial=self.step, disable=not cfg.run.progress, desc="opd train",
                   dynamic_ncols=True)
        while self.step < cfg.run.steps:
            t_step = time.perf_counter()
            tally = DomainTally()
            sums = {"loss": 0.0, "tokens": 0, "wait_s": 0.0, "rollout_s": 0.0, "response_tokens": 0, "responses": 0}
            latencies, stale, domain_loss, sft_losses, routed = [], [], {}, [], {}
            for i in range(accum):
                # 1-2. this batch: sampled before (pipelined) or now, from the current weights.
                t0 = time.perf_counter()
                batch = self.pending if self.pending is not None else self._submit(self._sample_batch())
                self.pending = None
                # Pipelining: sample the next batch and start its scoring before training this one.
                # The look-ahead also runs after the last batch (not submitted) so that a run
                # extended with --resume continues exactly as if it had never stopped.
                if cfg.run.pipeline:
                    self.pending = self._sample_batch()
                    # Before an evaluation the look-ahead is sent after it: a full-vocabulary
                    # stream holds its tokens in the teacher's budget until the next step reads
                    # it, and the evaluation's request could meet BUSY for as long.
                    if self.batches <= last_batch and not (i == accum - 1 and self._due(cfg.run.eval_every,
                                                                                     self.step + 1)):
                        self._submit(self.pending)
                sums["rollout_s"] += time.perf_counter() - t0
                stale.append(self.version - batch.policy_version)
                for seq in range(len(batch.rollouts)):
                    for t, w in batch.route_of(seq).weights.items():
                        self.teacher_samples[t] = self.teacher_samples.get(t, 0.0) + w
                        routed[t] = routed.get(t, 0.0) + w
                # 3-4. the teachers' answers, then loss and backward, micro-batch by micro-batch.
                out = self._train_batch(batch, 1.0 / accum, tally, sums)
                latencies += [a.latency_s for a in out["answers"].values()]
                sums["loss"] += out["loss"]
                sums["tokens"] += sum(batch.keep)
                sums["response_tokens"] += sum(len(ro.response_ids) for ro in batch.rollouts)
                sums["responses"] += len(batch.rollouts)
                for d, v in out["domain_loss"].items():
                    domain_loss[d] = domain_loss.get(d, 0.0) + v
                sft = self._sft_step(1.0 / accum)
                if sft is not None:
                    sft_losses.append(sft)
                    sums["loss"] += cfg.merge.sft.lambda_sft * sft / accum
            # 5. the optimizer step, then the rollout engine gets the new weights.
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0
                                                       else float("inf"))
            sums["lr"] = self.optimizer.param_groups[0]["lr"]   # the rate this step used, not the next one
            finite = bool(torch.isfinite(grad_norm))
            if finite:
                self.optimizer.step()
                self.version += 1
                self.nonfinite_in_a_row = 0
            else:   # AdamW would write NaN into every weight: the step is skipped, its batch spent
                self._skip_nonfinite_step(sums["loss"], domain_loss)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if finite:
                self.engine.sync_weights(self.model)
                for d, v in domain_loss.items():  # running-mean multipliers for the next step
                    self.multipliers[d] = self.normalizer.scale(d, v)
            self.staleness += stale
            elapsed = time.perf_counter() - t_step
            row = self._step_metrics(sums, tally, latencies, stale, grad_norm, elapsed, sft_losses)
            row.update({f"routed/{t}": n for t, n in routed.items()})
            self.metrics.log(self.step, row)
            bar.update(1)
            per_domain = {k.split("/", 1)[1]: f"{v:.3f}" for k, v in row.items() if k.startswith("kl/")}
            bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row.get('kl', float('nan')):.4f}",
                            tok_s=f"{row['tokens_per_s']:.0f}", teacher_s=f"{row['teacher_latency_s']:.3f}",
                            **(per_domain if len(per_domain) > 1 else {}))
            # Evaluation first, so that a checkpoint holds it (the card's history after a resume);
            # it leaves the random state as it found it, so training does not depend on it.
            if self._due(cfg.run.eval_every, self.step):
                self._evaluate()
                if self.pending is not None and not self.pending.futures and self.batches <= last_batch:
                    self._submit(self.pending)
            if self._due(cfg.run.checkpoint_every, self.step):
                self._checkpoint()
        bar.close()
        if self.launched.servers:  # the forked teachers are done (their clients first); the card keeps their WELCOMEs
            self.teachers.close()
            self.launched.stop_servers()
        # RUN/model: the distilled student as a loadable directory (LoRA merged in), with its tokenizer.
        save_final_model(self.model, self.tok, self.out / "model")
        plot_metrics(self.out, {"loss": ["loss", "sft_loss"], "kl": ["kl", "eval/kl"],
                                "response_length": ["response_len", "eval/response_len"],
                                "eval_accuracy": ["eval/accuracy"]})
        write_train_card(
            self.out, cfg, welcomes={t: self.teachers.welcome(t) for t in self.specs},
            student={"model_fingerprint": self.student_model_fp, "tokenizer_fingerprint": self.student_fp,
                     "trained_parameters": sum(p.numel() for p in self.model.parameters() if p.requires_grad)},
            teacher_samples=self.teacher_samples, tail_mass=self.tail_mass, staleness=self.staleness,
            prompts={d: len(v) for d, v in self.datasets.items()}, eval_prompts=len(self.eval_samples),
            evals=self.evals, warnings=self.warnings + self.launched.events, steps=self.step,
            skipped_lines={p: {"loaded": r.loaded, "skipped": r.skipped, "first": r.errors[0]}
                           for p, r in self.data_reports.items() if r.skipped},
            trimmed=self.trimmed)
        return {"step": self.step, "evals": self.evals, "out_dir": str(self.out)}

    def _skip_nonfinite_step(self, loss: float, domain_loss: dict[str, float]) -> None:
        """A step whose gradient is NaN or inf (a teacher answer no divergence can take, a loss
        that overflowed) leaves the weights as they were, said once per step in the card;
        MAX_NONFINITE_IN_A_ROW such steps in a row stop the run: something persists."""
        self.nonfinite_in_a_row += 1
        bad = {d: v for d, v in domain_loss.items() if not math.isfinite(v)}
        msg = (f"step {self.step + 1}: the gradient is not finite (loss {loss:.4g}"
               f"{f', from domain {sorted(bad)}' if bad else ''}); the step was skipped, the weights are unchanged")
        print(f"warning: {msg}", flush=True)
        self.warnings.append(msg)
        if self.nonfinite_in_a_row >= MAX_NONFINITE_IN_A_ROW:
            raise TrainError(f"{self.nonfinite_in_a_row} steps in a row had a gradient that is not finite (the "
                             f"last: {msg}); stopping. Check the domain's teachers (probe them with `opd probe`), "
                             f"optim.lr, and student.dtype; --resume continues from the last checkpoint")

    def _step_metrics(self, sums, tally: DomainTally, latencies, stale, grad_norm, elapsed, sft_losses) -> dict:
        cfg = self.cfg
        row = {"loss": sums["loss"], "lr": sums["lr"], "grad_norm": float(grad_norm),
               "tokens": sums["tokens"], "tokens_per_s": sums["tokens"] / max(elapsed, 1e-9),
               "step_s": elapsed, "rollout_s": sums["rollout_s"], "teacher_wait_s": sums["wait_s"],
               "teacher_latency_s": sum(latencies) / max(len(latencies), 1),
               "staleness": sum(stale) / len(stale)}
        kl = tally.row_mean("kl")
        if kl is not None:
            row["kl"] = kl
        tail = tally.row_mean("teacher_tail_mass")
        if tail is not None:
            row["teacher_tail_mass"] = tail
        if sft_losses:
            row["sft_loss"] = sum(sft_losses) / len(sft_losses)
        diag = tally.metrics(self.stop_ids, cfg.run.ngram)
        row.update(diag)
        domains = sorted({k.split("/")[1] for k in diag})
        for d in domains:
            if f"diag/{d}/kl" in diag:
                row[f"kl/{d}"] = diag[f"diag/{d}/kl"]
        row["response_len"] = sums["response_tokens"] / max(sums["responses"], 1)
        if sums["response_tokens"]:   # dense supervision on the tail after an answer is noise: cut
            row["trimmed_share"] = 1.0 - sums["tokens"] / sums["response_tokens"]
        self.trimmed[0] += sums["response_tokens"] - sums["tokens"]
        self.trimmed[1] += sums["response_tokens"]
        self._warn_lopsided({d: diag.get(f"diag/{d}/loss_share") for d in domains}, "loss share")
        return row

    def _warn_lopsided(self, values: dict, what: str) -> None:
        from opd.routing.normalize import lopsided

        for d in lopsided({k: v for k, v in values.items() if v is not None}, self.cfg.run.lopsided_factor):
            msg = (f"step {self.step}: domain {d!r} {what} {values[d]:.3g} is far from the other domains' "
                   f"({', '.join(f'{k}: {v:.3g}' for k, v in values.items() if v is not None)}); "
                   f"the student may be becoming lopsided (merge.domain_weights / merge.normalize)")
            self.warnings.append(msg)
            print("warning:", msg, flush=True)

    # -- evaluation -------------------------------------------------------------------------
    def _due(self, every: int, step: int) -> bool:
        """Whether something done every `every` steps (0: never), and after the last, falls on `step`."""
        return bool(every and step % every == 0) or step == self.cfg.run.steps

    @torch.no_grad()
    def _evaluate(self) -> dict | None:
        """Held-out KL to each sample's teacher (the training divergence, no T^2) and accuracy;
        the random number generators are left as they were."""
        if not self.eval_samples:
            return None
        state = rng_state()
        try:
            return self._evaluate_rows()
        finally:
            set_rng_state(state)

    def _evaluate_rows(self) -> dict:
        from opd.kernels import distill_loss

        r = self.cfg.rollout
        prompts = [encode_prompt(self.tok, s.prompt) for s in self.eval_samples]
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                n=1, seed=self.cfg.run.seed + 12_345)
        rollouts = self.engine.generate(prompts, params)
        keep = [self._trim(ro.response_ids) for ro in rollouts]
        batch = Batch(index=-1, samples=self.eval_samples, routes=self.eval_routes, rollouts=rollouts,
                      keep=keep, policy_version=self.version)
        answers = self.teachers.answers(self._submit(batch).futures)
        tally = DomainTally()
        accuracy: dict[str, list[float]] = {}
        for i, ro in enumerate(rollouts):
            tally.add_response(self.eval_routes[i].domain, ro.response_ids, ro.finish_reason)
        if self.verify is not None:
            texts = [self.tok.decode(ro.response_ids, skip_special_tokens=True) for ro in rollouts]
            for i, v in enumerate(self.verify(self.eval_samples, texts)):
                if v is not None:
                    accuracy.setdefault(self.eval_routes[i].domain, []).append(float(v))
        was = self.model.training
        self.model.eval()
        for t, seqs in batch.members.items():
            spec, ans = self.specs[t], answers[t]
            for j, s in enumerate(seqs):
                n = keep[s]
                if n == 0:
                    continue
                packed = distill.pack([rollouts[s].prompt_ids], [rollouts[s].response_ids[:n]], self.tok.pad_token_id)
                logits = distill.student_rows(self.model, packed, fused=False).float()
                idx = torch.arange(ans.row_offsets[j], ans.row_offsets[j] + n)
                teacher = ans.logits[idx].float().to(logits.device) if ans.topk is None else \
                    type(ans.topk)(*(x[idx].to(logits.device) for x in ans.topk))
                if isinstance(teacher, torch.Tensor) and teacher.shape[1] != logits.shape[1]:
                    v = min(teacher.shape[1], logits.shape[1])
                    teacher, logits = teacher[:, :v], logits[:, :v]
                kl = distill_loss(logits, teacher, beta=spec.divergence_beta, temperature=spec.temperature,
                                  reduction="none")
                d = self.eval_routes[rollouts[s].prompt_index].domain
                tally.add_rows(d, "kl", kl)
                tally.add_rows(d, "topk_overlap", topk_overlap(logits, self.teachers.topk_ids(spec, ans, idx)))
        self.model.train(was)
        self.teachers.finish(answers)
        diag = tally.metrics(self.stop_ids, self.cfg.run.ngram, prefix="eval")
        row = {k: v for k, v in diag.items() if not k.endswith("loss_share")}
        kl = tally.row_mean("kl")
        if kl is not None:
            row["eval/kl"] = kl
        for d in {k.split("/")[1] for k in diag}:
            if f"eval/{d}/kl" in diag:
                row[f"eval/kl/{d}"] = diag[f"eval/{d}/kl"]
        lens = [ro.response_ids for ro in rollouts]
        row["eval/response_len"] = sum(map(len, lens)) / len(lens)
        if accuracy:
            # Accuracy counts fully correct answers (score 1); the mean verifier score, with a code
            # answer's partial credit for the share of tests it passes, is its own metric.
            from opd.rl.rewards import accuracy as share_correct   # the verifier's module: here when it is

            every = [x for v in accuracy.values() for x in v]
            row["eval/accuracy"] = share_correct(every)
            row["eval/verifier_score"] = sum(every) / len(every)
            for d, v in accuracy.items():
                row[f"eval/accuracy/{d}"] = share_correct(v)
            if len(accuracy) > 1:
                self._warn_lopsided({d: row[f"eval/accuracy/{d}"] for d in accuracy}, "eval accuracy")
        self.metrics.log(self.step, row)
        self.evals.append({"step": self.step, **row})
        return row

    # -- checkpoint and card ----------------------------------------------------------------
    def _checkpoint(self) -> Path:
        state = {"batches": self.batches, "version": self.version, "trimmed": self.trimmed,
                 "sampler": self.sampler.state(),
                 "sft": self.sft.state() if self.sft is not None else None,
                 "normalizer": self.normalizer.state(), "multipliers": self.multipliers,
                 "staleness": self.staleness, "teacher_samples": self.teacher_samples,
                 "tail_mass": self.tail_mass, "evals": self.evals,
                 # the watchdog's restarts too: after a resume they are history the card keeps
                 "warnings": self.warnings + self.launched.events,
                 "pending": self.pending.to_state() if self.pending is not None else None,
                 "config": to_dict(self.cfg)}
        return save_checkpoint(self.out / "checkpoints", self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, state=state, keep=self.cfg.run.keep_checkpoints)

    def close(self) -> None:
        if hasattr(self, "engine"):
            self.engine.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "teachers"):
            self.teachers.close()
        self.launched.close()


def _verifier():
    """A batch verifier (samples, texts) -> [score | None] from opd.rl.rewards, when it is installed."""
    try:
        from opd.rl import rewards
    except ImportError:
        return None
    if hasattr(rewards, "verify_batch"):
        return rewards.verify_batch
    if hasattr(rewards, "verify"):
        return lambda samples, texts: [rewards.verify(s, t) for s, t in zip(samples, texts)]
    return None
