"""`opd train`'s loop: on-policy distillation of a student from live teacher servers.

One optimizer step (`Trainer.step`, read top to bottom):
  1. sample: draw prompts from the domains' mixture (each routed to its teachers when the
     data loaded, opd.distill.prompts), announce them to their teachers, and let the student
     roll them out; the teachers prefill the prompts meanwhile, and each response at a
     quarter, half and three quarters of its length (SCORE mode prefill, a teacher's prompt cache);
  2. submit: send each teacher the sequences routed to it, trimmed after the answer's end;
  3. forward: the student's response rows of the first micro-batch, while the teachers score;
  4. loss / backward: each teacher's divergence on its rows, per-domain weights, the SFT mix,
     micro-batch by micro-batch (opd.distill.loss);
  5. optimizer step (skipped, and said, when the gradient is not finite), then the rollout
     engine receives the new weights (weight sync).
With `rewards`, step 2 also scores each response with the verifiers and gives it its group's
advantage, which joins the teachers' signal in step 4 (opd.spine.objective).
With `agent`, step 1 samples multi-turn trajectories with tools (opd.distill.agentic), whose
rows are the model's own tokens alone.
With `run.max_staleness: K`, step 1 runs in a thread of its own with its own copy of the weights,
up to K optimizer steps ahead (opd.distill.ahead), and step 5 hands it the new weights.
Otherwise, with `run.pipeline`, steps 1-2 of the NEXT batch happen before steps 3-4 of the current one
(opd.distill.batch.Prefetcher), so the teachers score while the student trains; that batch's
rollouts then come from weights one optimizer step old (staleness 1, recorded per step and in
the card). Without it every batch is sampled from the current weights (staleness 0).

Deviation from the textbook: with `merge.normalize: running_mean`, a domain's multiplier is
its running mean loss up to the previous step (the current step's loss is only known after
its backward); the first step uses 1.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from opd.agent.trajectory import trajectory
from opd.config import to_dict
from opd.data import encode_prompt
from opd.distill import agentic
from opd.distill.ahead import RunAhead, load_into, own_copy
from opd.distill.batch import Batch, Prefetcher, trimmed
from opd.distill.card import write_train_card
from opd.distill.context import support_k, teacher_inputs, teacher_prompts
from opd.distill.config import TrainConfig
from opd.distill.evaluate import evaluate
from opd.distill.launch import RunTeachers
from opd.distill.loss import sft_mix, train_batch
from opd.distill.pass_rates import PassRates
from opd.distill.prompts import load_prompts
from opd.distill.stats import History, StepStats
from opd.distill.stored import open_store
from opd.distill import memory as full_mode
from opd.teachers.session import TeacherSet
from opd.fingerprint import model_fingerprint, tokenizer_fingerprint
from opd.lm_head import FUSED_REFUSED, head_form
from opd.rewards import build_reward, verify_batch
from opd.rewards.combine import check_reward_fields
from opd.rollout.base import SamplingParams, eos_ids
from opd.rollout.hf import HFRolloutEngine
from opd.routing.normalize import DomainLossNormalizer
from opd.spine import objective
from opd.spine.dist import World, memory_per_rank
from opd.spine.model import load_policy, load_tokenizer, make_engine
from opd.spine.optim import NonfiniteSteps, TrainError, build_optimizer, optimizer_step
from opd.spine.rows import trim_length
from opd.spine.run import RunDir

__all__ = ["Trainer", "TrainError"]

# Config keys a resumed run must share with its checkpoint (opd.checkpoint.resume_changes):
# they define the objective, so another value would make the card's one description of the
# run false for the steps before the resume. Other keys (steps, lr, evaluation, where the
# teachers listen, ...) may change and are listed in the card.
RESUME_FIXED = ("student.path", "student.dtype", "student.lora", "student.lora.*", "merge.teachers.*",
                "merge.datasets", "merge.routing.*", "merge.sft", "merge.sft.*", "merge.domain_weights*",
                "merge.normalize*", "loss.*", "rollout.temperature", "rollout.top_p", "rollout.samples_per_prompt",
                "rollout.prompts_per_step", "rollout.max_new_tokens", "run.seed", "rewards", "rewards.*", "agent",
                "agent.*", "terms.*")
RESUME_FREE = ("merge.teachers.*.address", "merge.teachers.*.curve_server_key", "loss.impl", "loss.fused_linear",
               "agent.workers")
NONFINITE_HINT = "Check the domain's teachers (probe them with `opd probe`), optim.lr, and student.dtype"
PLOTS = {"loss": ["loss", "sft_loss"], "kl": ["kl", "eval/kl"], "response_length": ["response_len", "eval/response_len"],
         "eval_accuracy": ["eval/accuracy"]}


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: str | Path | bool | None = None, base_dir: str | Path = ".",
                 fork_teachers: bool = False, overwrite: bool = False, world: World = World()):
        """resume: True (the newest checkpoint under run.out_dir) or a checkpoint directory.
        overwrite: a fresh run may replace an earlier run in run.out_dir (else it is refused).
        fork_teachers: with cluster.mode fork, fork the teacher servers from this process (what
        `opd train` does, before it computes anything); False starts them as subprocesses, which
        a process that may already have run torch (a notebook, a test) needs: a forked child
        hangs in the OpenMP thread pool its parent used. world: the ranks the student is sharded
        over (opd.spine.dist): each samples its share of every step's prompts and asks its own
        clients of the teachers; rank 0 starts the teachers cluster.mode starts, and writes."""
        self.cfg = cfg
        self.world = world
        self.out = Path(cfg.run.out_dir)
        self.launched = RunTeachers(self.out, fork=fork_teachers)   # what cluster.mode starts
        self.base_dir = Path(base_dir)
        self.resume, self.overwrite = resume, overwrite
        self.steps_done = 0       # optimizer steps, skipped ones included
        self.version = 0          # optimizer steps applied: the weights' version
        self.batches = 0          # batches drawn (the data position)
        self.last_batch = cfg.run.steps * cfg.optim.grad_accum
        self.history = History.start([t.name for t in cfg.merge.teachers], quiet=not world.main)
        self.verify = verify_batch   # (samples, texts) -> [score | None]: evaluation's accuracy
        self.last_drowned = -10**9   # the step of the last "one signal drowns the other" warning

    # -- setup: everything checked before the first step ----------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        world = self.world
        self.run_dir = RunDir(self.out, to_dict(cfg), resume=self.resume, overwrite=self.overwrite,
                              fixed=RESUME_FIXED, free=RESUME_FREE, world=world)
        if self.run_dir.changed:
            self.history.warnings.append(f"resumed from {self.run_dir.resume_from.name}; changed since that "
                                         f"checkpoint: {', '.join(self.run_dir.changed)}")
        # Teachers are checked (reachable, same tokenizer) before the student is even loaded.
        tokenizer = load_tokenizer(cfg.student.path, "student.path")
        self.student_fp = tokenizer_fingerprint(tokenizer)
        # Forked teachers (rank 0 starts them): the ports they bound are in the addresses.
        self.cfg = cfg = world.main_first(lambda: self.launched.start(cfg))
        self.run_dir.config = to_dict(cfg)
        cluster = self.launched.cluster
        # With `store`, the answers and the sequences are a store's (opd.distill.stored): no teacher runs.
        self.store = open_store(cfg.store, cfg.merge.teachers[0], self.student_fp, cfg.run.seed) \
            if cfg.store is not None else None
        self.teachers = self.store.teachers if self.store is not None else TeacherSet(
            cfg.merge.teachers, cfg.teacher_client, self.student_fp, cfg.student.path, full_dtype=cfg.loss.full_dtype,
            cluster=cluster, on_ray={t.name for t in cfg.cluster.teachers} if cluster is not None else set(),
            check_memory=lambda vocab, n: full_mode.check_full_memory(cfg, vocab, full_mode.mem_available(), teachers=n),
            student_tokenizer=tokenizer)
        for note in [self.teachers.memory_note, *self.teachers.vocab_notes]:
            if note:
                self.history.warn(note)
        torch.manual_seed(cfg.run.seed)
        shards = cfg.cluster.student
        self.model, self.tok = load_policy(cfg.student, seed=cfg.run.seed, tokenizer=tokenizer, world=world,
                                           mixed_precision=shards.precision(), cpu_offload=shards.cpu_offload)
        if cfg.loss.fused_linear and not head_form(self.model).fusable:
            raise TrainError(f"loss.fused_linear: student {cfg.student.path}: {FUSED_REFUSED}")
        self.student_model_fp = model_fingerprint(cfg.student.path)
        teacher_positions = {t: self.teachers.welcome(t).max_positions for t in self.teachers.specs}
        self.tools = agentic.schemas(cfg, self.tok, self.base_dir)   # None: single-turn rollouts
        self.prompts = self.store.prompts if self.store is not None else load_prompts(cfg, self.tok, self.base_dir,
                                    getattr(self.model.config, "max_position_embeddings", 0) or 0,
                                    {t: n for t, n in teacher_positions.items() if n > 0}, self.tools)
        self.history.warnings += self.prompts.warnings
        self.pass_rates = PassRates(cfg.merge.routing, self.prompts.router, self.prompts.held_out)
        self.reward = build_reward(cfg.rewards, base_dir=self.base_dir) if cfg.rewards else None
        if cfg.rewards:
            check_reward_fields(cfg.rewards, [s for v in self.prompts.datasets.values() for s in v],
                                ", ".join(d.path for d in cfg.merge.datasets))
        self.stop_ids = eos_ids(self.tok, getattr(self.model, "generation_config", None))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.run.steps)
        self.nonfinite = NonfiniteSteps(NONFINITE_HINT)
        self.normalizer = DomainLossNormalizer(cfg.merge.normalize, cfg.merge.normalize_momentum)
        self.multipliers: dict[str, float] = {}
        self.prefetch = Prefetcher(self._sample_batch, self._submit,
                                   enabled=cfg.run.pipeline and cfg.run.max_staleness is None and cfg.store is None)
        state = self.run_dir.restore(self.model, self.optimizer, self.scheduler)
        self._restore(state)
        self.engine = agentic.wrap(cfg, make_engine(cfg.rollout, cfg.student, self.model, self.tok, seed=cfg.run.seed,
                                                    world=world), self.tok, self.stop_ids, self.base_dir)
        self.ahead = self._run_ahead(state.get("ahead", [])) if cfg.run.max_staleness is not None else None
        self.metrics = self.run_dir.metrics(tensorboard=cfg.run.tensorboard)

    # -- one optimizer step ---------------------------------------------------------------------
    def step(self) -> dict:
        """One optimizer step, top to bottom; its metrics line."""
        cfg, accum = self.cfg, self.cfg.optim.grad_accum
        stats, t_step = StepStats(), time.perf_counter()
        for i in range(accum):
            # 1-2. sample, route and submit: this batch was sampled and sent by the look-ahead a
            # step ago (run.pipeline), or is now; the look-ahead then samples the next one, and
            # sends it unless an evaluation comes first or the run ends with this batch.
            t0 = time.perf_counter()
            if self.ahead is not None:   # sampled by the thread; sent now, with the batches after it
                batch = self.ahead.take()
                for b in [batch] + ([] if self.teachers.has_full else self.ahead.queued()):
                    if not b.futures:
                        self._submit(b)
            else:
                batch = self.prefetch.take()
                evaluation_next = i == accum - 1 and self._due(cfg.run.eval_every, self.steps_done + 1)
                self.prefetch.look_ahead(send=self.batches <= self.last_batch and not evaluation_next)
            stats.rollout_s += time.perf_counter() - t0
            stats.add_batch(batch, self.version)
            if self.reward is not None:   # the verifiers' group advantages (opd.rl.grpo)
                self._score(batch, stats)
            # 3-4. the student's rows, the teachers' answers, loss and backward per micro-batch.
            self._train_batch(batch, stats, 1.0 / accum)
            if self.prompts.sft is not None:   # the SFT mix: cross-entropy on reference responses
                sft = cfg.merge.sft
                pairs = self.world.shard(self.prompts.sft.take(sft.batch_size))
                stats.sft_losses.append(sft_mix(self.model, self.tok, pairs, sft.lambda_sft, 1 / accum, self.world))
        stats = stats.merged(self.world)   # every rank's share of the step
        stats.loss += sum(cfg.merge.sft.lambda_sft * ce / accum for ce in stats.sft_losses)
        # 5. the optimizer step (skipped if the gradient is not finite), then the weight sync.
        lr = self.optimizer.param_groups[0]["lr"]   # the rate this step uses, not the next one
        grad_norm, applied = optimizer_step(self.optimizer, self.params, cfg.optim.grad_clip)
        skipped = self.nonfinite.check(self.steps_done + 1, applied, self._nonfinite_detail(stats))
        self.scheduler.step()
        self.steps_done += 1
        self.version += applied
        if self.ahead is not None:   # the thread loads the new weights between two batches
            self.ahead.step_done(self.model, self.version, applied)
        elif applied:
            self.engine.sync_weights(self.model)
        if applied:
            for d, v in stats.domain_loss.items():   # running-mean multipliers for the next step
                self.multipliers[d] = self.normalizer.scale(d, v)
        else:
            self.history.warn(skipped)
        self.history.add_step(stats)
        row = stats.row(lr=lr, grad_norm=grad_norm, elapsed=time.perf_counter() - t_step, stop_ids=self.stop_ids,
                        ngram=cfg.run.ngram)
        self.history.warn_lopsided(self.steps_done, StepStats.loss_shares(row), "loss share", cfg.run.lopsided_factor)
        drowned = stats.drowned(cfg.loss.drown_factor)
        if drowned and self.steps_done - self.last_drowned >= 10:
            self.last_drowned = self.steps_done
            self.history.warn(f"step {self.steps_done}: {drowned}")
        return row

    def _score(self, batch: Batch, stats: StepStats) -> None:
        """Each response's reward, and its advantage within its prompt's group (a group whose
        rewards are all equal gets 0: no gradient, counted in groups/all_equal), or with
        `loss.reward_advantage: batch` against the step's other responses (the batch one group)."""
        texts = [ro.text(self.tok) for ro in batch.rollouts]
        trajs = [trajectory(ro, self.tok) for ro in batch.rollouts] if self.cfg.agent is not None else None
        total, _ = self.reward([batch.samples[ro.prompt_index] for ro in batch.rollouts], texts, trajs)
        rewards_P_G = torch.tensor(total, dtype=torch.float32).view(-1, self.cfg.rollout.samples_per_prompt)
        batch.rewards = total
        if self.cfg.loss.reward_advantage == "batch":   # over the whole step: every rank's responses
            adv = objective.batch_advantages(torch.tensor(total), objective.ranks_total(
                torch.tensor(total, dtype=torch.float64), torch.ones(len(total)), self.world))
            flat = torch.tensor(total)[None]   # one group: the batch
        else:
            adv, flat = objective.group_advantages(rewards_P_G, self.cfg.loss.reward_advantage), rewards_P_G
        batch.advantages = adv.flatten().tolist()
        stats.rewards += total
        stats.flat_groups = [stats.flat_groups[0] + int(objective.equal_groups(flat).sum()),
                             stats.flat_groups[1] + flat.shape[0]]

    def _run_ahead(self, queued: list[dict]) -> RunAhead:
        """run.max_staleness: the sampling thread, with its own engine (hf: over a copy of the
        student; vllm: the engine, whose workers hold their own weights)."""
        cfg = self.cfg
        if cfg.rollout.engine == "hf":
            copy = own_copy(self.model)
            engine, load = make_engine(cfg.rollout, cfg.student, copy, self.tok, seed=cfg.run.seed), load_into(copy)
            engine = agentic.wrap(cfg, engine, self.tok, self.stop_ids, self.base_dir)
        else:
            engine, load = self.engine, None
        ahead = RunAhead(self._sample_batch, engine, max_staleness=cfg.run.max_staleness,
                         grad_accum=cfg.optim.grad_accum, next_batch=self.batches, steps_done=self.steps_done,
                         last_batch=self.last_batch, version=self.version, load=load)
        ahead.load_queue([Batch.from_state(b) for b in queued])
        return ahead.start()

    def _sample_batch(self, engine=None, version: int | None = None) -> Batch:
        """Draw prompts (each with the route it got at load) and sample the student's responses
        (of this rank's share of the prompts, drawing what one process would draw for them)
        with `engine` (the run's), whose weights are of `version` (the trained ones)."""
        r, world = self.cfg.rollout, self.world
        if self.store is not None:   # the next stored sequences, prompts_per_step x samples_per_prompt: none sampled
            self.batches += 1
            return self.store.batches.batch(self.batches - 1, r.prompts_per_step * r.samples_per_prompt, self.version,
                                            self.stop_ids)
        samples = world.shard(self.prompts.sampler.sample(r.prompts_per_step))
        share = (world.rank * len(samples) * r.samples_per_prompt, r.prompts_per_step * r.samples_per_prompt) \
            if world.sharded else None
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                                n=r.samples_per_prompt, seed=self.cfg.run.seed * 1_000_003 + self.batches, share=share,
                                topk=support_k(self.cfg.merge.teachers))
        routes = [self.prompts.routes[id(s)] for s in samples]
        rollouts = self.rollout(engine or self.engine, samples, routes, params)
        keep, masks = trimmed(rollouts, self.trim)
        batch = Batch(index=self.batches, samples=samples, routes=routes,
                      rollouts=rollouts, keep=keep, masks=masks,
                      policy_version=self.version if version is None else version)
        self.batches += 1
        return batch

    def rollout(self, engine, samples: list, routes: list, params: SamplingParams) -> list:
        """The student's responses to `samples` from `engine`. The prompts are announced first
        to the teachers they are routed to, which prefill them while the student samples, and
        (hf engine, single turns) each response, trimmed, as it grows (SCORE mode prefill)."""
        prompts = [self.encode(s) for s in samples]
        seen = {}   # teacher -> {prompt index: what the teacher sees before the response}
        for t, spec in self.teachers.specs.items():
            mine = [i for i, route in enumerate(routes) if t in route.weights]
            if mine:
                ahead = teacher_prompts(spec, self.tok, [samples[i] for i in mine], [prompts[i] for i in mine],
                                        self.tools)
                self.teachers.prefill(t, ahead)
                seen[t] = dict(zip(mine, ahead))

        def partial(rows: list[tuple[int, list[int]]]) -> None:
            rows = [(i, r[:self.trim(r)]) for i, r in rows]
            for t, before in seen.items():
                mine = [(before[i], r) for i, r in rows if i in before and r]
                if mine:
                    self.teachers.prefill(t, [p + r for p, r in mine], [len(p) for p, _ in mine])

        hooked = isinstance(engine, HFRolloutEngine)   # not an agent's multi-turn wrapper around one
        if hooked:
            engine.partial = partial
        try:
            return engine.generate(prompts, params)
        finally:
            if hooked:
                engine.partial = None

    def _submit(self, batch: Batch) -> Batch:
        """Send every teacher the sequences routed to it (prompt + trimmed response; multi-turn:
        with the rows it scores, SCORE's row mask)."""
        for t, (sequences, starts, rows) in batch.requests().items():
            seqs = batch.members[t]   # what the teacher sees besides them, and where it looks (context, support)
            extra = teacher_inputs(self.teachers.specs[t], self.teachers.tokenizer(t, self.tok),
                                   [batch.samples[batch.rollouts[s].prompt_index] for s in seqs],
                                   [batch.rollouts[s] for s in seqs], [batch.keep[s] for s in seqs], rows,
                                   self.tools)
            if rows is not None:   # a single-turn request stays what a server without row masks reads
                extra["rows"] = rows
            batch.futures[t] = self.teachers.request(t, sequences, starts, **extra)
        return batch

    def _train_batch(self, batch: Batch, stats: StepStats, scale: float) -> None:
        domains = {batch.route_of(s).domain for s in range(len(batch.rollouts))}
        lam = {d: self.cfg.merge.domain_weights.get(d, 1.0) * self.multipliers.get(d, 1.0) for d in domains}
        train_batch(self.model, batch, self.teachers, cfg=self.cfg, lam=lam, pad_id=self.tok.pad_token_id,
                    scale=scale, stats=stats, world=self.world, stale=batch.policy_version < self.version)

    @staticmethod
    def _nonfinite_detail(stats: StepStats) -> str:
        bad = sorted(d for d, v in stats.domain_loss.items() if not math.isfinite(v))
        return f" (loss {stats.loss:.4g}{f', from domain {bad}' if bad else ''})"

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self.setup()
            return self.train()
        finally:
            self.close()

    def train(self) -> dict:
        """Steps until run.steps, with evaluations and checkpoints; then the model, plots, card."""
        cfg = self.cfg
        if self.steps_done == 0:
            self.refresh_pass_rates()
            self.evaluate()
        bar = tqdm(total=cfg.run.steps, initial=self.steps_done, disable=not (cfg.run.progress and self.world.main),
                   desc="opd train", dynamic_ncols=True)
        while self.steps_done < cfg.run.steps:
            row = self.step()
            self.metrics.log(self.steps_done, row)
            bar.update(1)
            per_domain = {k.split("/", 1)[1]: f"{v:.3f}" for k, v in row.items() if k.startswith("kl/")}
            bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row.get('kl', float('nan')):.4f}",
                            tok_s=f"{row['tokens_per_s']:.0f}", teacher_s=f"{row['teacher_latency_s']:.3f}",
                            **(per_domain if len(per_domain) > 1 else {}))
            if self.pass_rates.due(self.steps_done) and self.steps_done < cfg.run.steps:
                self.refresh_pass_rates()
            # Evaluation first, so that a checkpoint holds it (the card's history after a resume).
            if self._due(cfg.run.eval_every, self.steps_done):
                self.evaluate()
                if self.batches <= self.last_batch:
                    self.prefetch.send_held()
            if self._due(cfg.run.checkpoint_every, self.steps_done):
                self._checkpoint()
        bar.close()
        return self._finish()

    def evaluate(self) -> dict | None:
        """A held-out evaluation (opd.distill.evaluate), logged and kept for the card."""
        if not self.prompts.eval_samples:
            return None
        if self.ahead is not None and self.cfg.rollout.engine == "vllm":   # the thread's engine: its turn
            with self.ahead.paused():
                row = evaluate(self)
        else:
            row = evaluate(self)
        self.metrics.log(self.steps_done, row)
        self.history.warn_kl_without_accuracy(self.steps_done, row)
        self.history.evals.append({"step": self.steps_done, **row})
        return row

    def refresh_pass_rates(self) -> None:
        """The teachers' pass rates measured again and the routes reweighed (opd.distill.pass_rates)."""
        if self.pass_rates.due(self.steps_done):
            self.metrics.log(self.steps_done, self.pass_rates.refresh(self.steps_done, self))

    def _due(self, every: int, step: int) -> bool:
        """Whether something done every `every` steps (0: never), and after the last, falls on `step`."""
        return bool(every and step % every == 0) or step == self.cfg.run.steps

    def encode(self, sample) -> list[int]:
        return encode_prompt(self.tok, sample.chat, tools=self.tools)

    def trim(self, response: list[int]) -> int:
        """Kept tokens of one turn's ids (loss.trim); a trajectory's turns each (trim_turns)."""
        loss = self.cfg.loss
        return trim_length(response, eos_ids=self.stop_ids, trim=loss.trim, marker=loss.answer_end_marker,
                           tokenizer=self.tok)

    # -- checkpoints, the end -------------------------------------------------------------------
    def _checkpoint(self) -> Path:
        if self.ahead is not None:   # the thread idle: the data position and its queue agree
            with self.ahead.paused():
                return self._save()
        return self._save()

    def _save(self) -> Path:
        history = self.history.state()
        # the watchdog's restarts too: after a resume they are history the card keeps
        history["warnings"] = history["warnings"] + self.launched.events
        pending = self.world.gather(self.prefetch.state())   # each rank's look-ahead: its share
        state = {"batches": self.batches, "version": self.version, "sampler": self.prompts.sampler.state(),
                 "sft": self.prompts.sft.state() if self.prompts.sft is not None else None,
                 "normalizer": self.normalizer.state(), "multipliers": self.multipliers,
                 "pass_rates": self.pass_rates.state(),
                 **({"ahead": [b.to_state() for b in self.ahead.queued()]} if self.ahead is not None else {}),
                 **({"pending": pending[0]} if not self.world.sharded else {"pending_by_rank": pending}), **history}
        return self.run_dir.save(self.steps_done, self.model, self.optimizer, self.scheduler, state=state,
                                 keep=self.cfg.run.keep_checkpoints)

    def _restore(self, state: dict) -> None:
        """The run's position from a checkpoint's state ({}: a fresh run)."""
        if not state:
            return
        self.steps_done = state["step"]
        self.version = state.get("version", self.steps_done)   # fewer than steps when a step was skipped
        self.batches = state["batches"]
        self.prompts.sampler.load_state(state["sampler"])
        if self.prompts.sft is not None and state.get("sft") is not None:
            self.prompts.sft.load_state(state["sft"])
        self.normalizer.load_state(state["normalizer"])
        self.multipliers = state["multipliers"]
        if state.get("pass_rates") and self.pass_rates.every:   # the measured weights, as the run left them
            self.pass_rates.load_state(state["pass_rates"])
            self.pass_rates.apply(None)
            self.pass_rates.reroute(self.prompts)
        self.history.load_state(state)
        by_rank = state.get("pending_by_rank") or [state.get("pending")]
        if len(by_rank) != self.world.size and any(by_rank):
            raise TrainError(f"{self.run_dir.resume_from} holds the look-ahead batches of {len(by_rank)} ranks; resume "
                             f"it on {len(by_rank)} (cluster.student.num_workers), or with run.pipeline: false "
                             f"checkpoints resume on any number")
        self.prefetch.load_state(by_rank[self.world.rank] if len(by_rank) == self.world.size else None)
        if self.world.main:
            print(f"resumed from {self.run_dir.resume_from} at step {self.steps_done}", flush=True)

    def _finish(self) -> dict:
        if self.launched.servers:  # the forked teachers are done (their clients first); the card keeps their WELCOMEs
            self.teachers.close()
            self.launched.stop_servers()
        memory = memory_per_rank(self.model, self.optimizer)
        self.run_dir.finish(self.model, self.tok, PLOTS, self.cfg.student)   # RUN/model: the student, LoRA merged in
        h = self.history
        if not self.world.main:
            return {"step": self.steps_done, "evals": h.evals, "out_dir": str(self.out)}
        write_train_card(
            self.out, self.cfg, welcomes={t: self.teachers.welcome(t) for t in self.teachers.specs},
            student={"model_fingerprint": self.student_model_fp, "tokenizer_fingerprint": self.student_fp,
                     "trained_parameters": sum(p.numel() for p in self.params)},
            teacher_samples=h.teacher_samples, tail_mass=h.tail_mass, staleness=h.staleness,
            prompts={d: len(v) for d, v in self.prompts.datasets.items()},
            eval_prompts=len(self.prompts.eval_samples), evals=h.evals, warnings=h.warnings + self.launched.events,
            steps=self.steps_done, cross=h.cross,
            skipped_lines={p: {"loaded": r.loaded, "skipped": r.skipped, "first": r.errors[0]}
                           for p, r in self.prompts.reports.items() if r.skipped},
            trimmed=h.trimmed, ranks=self.world.size, memory=memory, importance=h.importance, agent=h.agent,
            teacher_weights=self.pass_rates.card())
        return {"step": self.steps_done, "evals": h.evals, "out_dir": str(self.out)}

    def close(self) -> None:
        if getattr(self, "ahead", None) is not None:
            self.ahead.close()
        if hasattr(self, "engine"):
            self.engine.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "teachers"):
            self.teachers.close()
        self.launched.close()
