"""GRPO training of a domain expert against verifiable rewards, one loop read top to bottom.

Each step:
  1. take P prompts; sample G responses to each with the current policy
  2. score every response with the weighted reward functions; with
     algorithm.dynamic_sampling, draw more prompts to replace the groups whose rewards are all
     equal (DAPO), up to that many more draws
  3. group-relative advantages (grpo / dr_grpo / batch_std / rloo); all-equal groups get 0
  4. the reference's log-probs of the sampled tokens (only when kl_beta > 0): with LoRA the
     same model with its adapter switched off, with full fine-tuning a frozen copy
  5. `epochs` passes of clipped-surrogate updates against the rollout log-probs, plus
     beta * KL(policy || reference), aggregated as configured
  6. metrics (reward, group std, share of all-equal groups, length, clip fraction, KL,
     entropy), a warning when most groups carry no signal, eval, checkpoint
With `teachers`, step 1 also sends the responses to the teacher servers, and in step 5 each
token's advantage gains each teacher's -lambda * (log pi - log pi_teacher), discounted with
its gamma (opd.spine.objective: the objective `opd train` computes with `rewards`).
With `agent`, step 1 samples multi-turn trajectories with tools, and only the tokens the policy
sampled are trained (rl/agentic.py).

The card is written at the start and rewritten with the results at the end. A checkpoint
holds the run's config: `--resume` with another value of a key that defines the objective
(rl/resume.py) is refused, other changes are listed in the card. Loading the policy, the
rollout engine, the optimizer and the run directory are the training spine's (opd/spine).

Deviation from DeepSeekMath's GRPO worth knowing: the importance ratio is taken against
the rollout engine's raw log-probs (what `Rollout.logprobs` holds), not a recomputed
forward pass; with the hf engine these are the same weights, so the first epoch's ratio
is 1 up to float noise. For that the policy's dropout is off (`disable_dropout`): the
engines sample without it. See docs/grpo.md.

With `cluster.mode: ray` step 1 runs on `rollout.actors` Ray actors (opd/cluster/rollout.py),
each with its own copy of the policy; after step 5 the trainable weights are written to
RUN/rollout_weights.safetensors and every actor loads that file (only the path goes
through Ray), so the next step samples from the updated policy. docs/multi_machine.md.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from opd.agent.trajectory import trajectory
from opd.rl import agentic
from opd.rl import resume as resume_rules
from opd.rl.batch import RolloutRows, collate
from opd.rl.card import summary as summarize
from opd.rl.groups import keep_informative, verifier_verdict
from opd.rl.card import write_grpo_card
from opd.rl.evaluate import evaluate
from opd.rl.logprobs import token_logprobs_and_entropy
from opd.cluster.rollout import PoolEngine
from opd.cluster.session import RayCluster
from opd.config import to_dict
from opd.data import Cycler, encode_prompt, load_jsonl
from opd.metrics import read_metrics
from opd.rl import grpo
from opd.rl.config import RLConfig
from opd.rewards import build_reward
from opd.rewards.combine import check_reward_fields
from opd.rollout import SamplingParams
from opd.spine.dist import World, memory_per_rank
from opd.spine.model import load_policy, make_engine
from opd.spine.optim import NonfiniteSteps, build_optimizer, optimizer_step
from opd.spine.run import RunDir
from opd.spine import objective
from opd.spine.terms import token_loss as term_loss
from opd.rl import teachers as rl_teachers
from opd.rl.teachers import TeacherTerm


PLOT_GROUPS = {
    "reward": ["reward"], "groups": ["groups"], "length": ["length"], "kl": ["kl"],
    "clip_fraction": ["clip_fraction"], "entropy": ["entropy"], "loss": ["loss"], "eval": ["eval"],
    "agent": ["agent/turns", "agent/tool_calls", "agent/tool_failure_share", "agent/turn_limit_rate"],
}


# ---- the trainer --------------------------------------------------------------------------

class GRPOTrainer:
    def __init__(self, cfg: RLConfig, *, config_dir: str | Path | None = None, resume: bool = False,
                 overwrite: bool = False, world: World = World()):
        """overwrite: a fresh run may replace an earlier run in run.out_dir (else it is refused).
        world: the ranks the policy is sharded over (opd.spine.dist): each samples, scores and
        trains on its share of every step's prompts, whole groups each."""
        self.cfg = cfg
        self.world = world
        self.out = Path(cfg.run.out_dir)
        # --resume: the checkpoint's config checked against this one before the model loads.
        self.run_dir = RunDir(self.out, to_dict(cfg), resume=resume, overwrite=overwrite, fixed=resume_rules.FIXED,
                              free=resume_rules.FREE, view=resume_rules.view, world=world)
        # Data and rewards before the model: their mistakes are said in a second, not after a load.
        train_samples, self.train_report = load_jsonl(cfg.data.train, on_error=cfg.data.on_error)
        self.eval_samples = (load_jsonl(cfg.data.eval, on_error=cfg.data.on_error)[0][:cfg.data.eval_prompts]
                             if cfg.data.eval else [])
        self.reward = build_reward(cfg.rewards, base_dir=config_dir)
        check_reward_fields(cfg.rewards, train_samples, cfg.data.train)
        torch.manual_seed(cfg.run.seed)
        # Dropout off: the importance ratio compares with the engines' dropout-free log-probs.
        shards = cfg.cluster.student
        self.model, self.tokenizer = load_policy(cfg.model, dropout=False, world=world,
                                                 mixed_precision=shards.precision(), cpu_offload=shards.cpu_offload)
        self.pad_id = self.tokenizer.pad_token_id
        self.tools = agentic.toolbox(cfg.agent, self.tokenizer, cfg.model.path, config_dir)   # None: one turn
        self.agent_sums: list[float] | None = None   # the run's trajectories, for the card (rl/agentic.py)
        self.is_lora = cfg.model.lora is not None
        # Full fine-tuning needs its own frozen reference; LoRA switches the adapter off instead.
        # Sharded, the reference is sharded too (a second load: a sharded module is not copied).
        self.reference = None
        if cfg.algorithm.kl_beta > 0 and not self.is_lora:
            self.reference = (load_policy(cfg.model, dropout=False, world=world, mixed_precision=shards.precision(),
                                          cpu_offload=shards.cpu_offload)[0] if world.sharded
                              else copy.deepcopy(self.model)).eval().requires_grad_(False)
        self.data = Cycler(train_samples, seed=cfg.run.seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.run.steps)
        self.nonfinite = NonfiniteSteps("Check the rewards, optim.lr and model.dtype")
        self.last_flat_warning = -10**9
        self.last_drowned = -10**9
        self.memory: dict | None = None   # bytes per rank, for the card at the end
        # The card's history, kept in every checkpoint: the warnings printed and the resumes
        # (each with the config keys changed since its checkpoint).
        self.warnings: list[str] = []
        self.resumes: list[dict] = []
        state = self.run_dir.restore(self.model, self.optimizer, self.scheduler)
        self.start_step = int(state.get("step", 0))
        if state:
            self.data.load_state(state["data"])
            self.warnings = list(state.get("warnings", []))
            self.agent_sums = state.get("agent")
            self.last_flat_warning = int(state.get("last_flat_warning", self.last_flat_warning))
            self.resumes = list(state.get("resumes", [])) + [
                {"at_step": self.start_step, "checkpoint": self.run_dir.resume_from.name,
                 "changed": self.run_dir.changed}]
        self.teachers = rl_teachers.connect(cfg, self.tokenizer) if cfg.teachers else None
        self.cluster, self._ray_started = None, False
        # Rollout actors serve one training process; sharded ranks (Ray's too) sample from their shards.
        actors = cfg.cluster.mode == "ray" and not world.sharded
        self.engine = agentic.wrap(cfg.agent, self.start_ray_engine() if actors else make_engine(
            cfg.rollout, cfg.model, self.model, self.tokenizer, seed=cfg.run.seed, world=world),
            self.tools, self.tokenizer, getattr(self.model, "generation_config", None))

    # -- the loop --------------------------------------------------------------------------

    def train(self) -> dict:
        cfg, P, G = self.cfg, self.cfg.rollout.prompts_per_step, self.cfg.rollout.samples_per_prompt
        logger = self.run_dir.metrics(tensorboard=cfg.run.tensorboard)
        # After --resume the summary covers the whole run: the steps before it from metrics.jsonl.
        history = [r for r in read_metrics(self.out / "metrics.jsonl")
                   if "reward/mean" in r and r.get("step", 0) <= self.start_step] if self.start_step else []
        world = self.world
        if world.main:
            self.write_card()   # the settings now; rewritten with the results at the end
        bar = tqdm(range(self.start_step, cfg.run.steps), initial=self.start_step, total=cfg.run.steps,
                   desc="grpo", dynamic_ncols=True, disable=not (cfg.run.progress and world.main))
        try:
            for step in bar:
                t0 = time.time()
                # 1. P prompts, G responses each, from the current policy (this rank's share of them)
                samples_P, rollouts_B = self.sample(step)
                dynamic = cfg.algorithm.dynamic_sampling > 0
                teachers = self.teachers is not None
                futures = rl_teachers.submit(self.teachers, cfg.teachers, rollouts_B, samples_P) \
                    if teachers and not dynamic else None
                t_rollout = time.time() - t0
                # 2. rewards (dynamic sampling: more draws replace the groups whose rewards are all equal)
                rewards_B, parts = self.rewards_of(samples_P, rollouts_B)
                t_reward = time.time() - t0 - t_rollout
                if dynamic:
                    def draw(k: int):
                        samples, rollouts = self.sample(step, k)
                        return (samples, rollouts, *self.rewards_of(samples, rollouts))
                    samples_P, rollouts_B, rewards_B, parts, drawn = keep_informative(
                        (samples_P, rollouts_B, rewards_B, parts), draw, cfg.algorithm.dynamic_sampling, world)
                    futures = rl_teachers.submit(self.teachers, cfg.teachers, rollouts_B, samples_P) \
                        if teachers else None
                    drawn["time/resample"] = time.time() - t0 - t_rollout - t_reward   # the extra draws
                # 3. group-relative advantages, over every rank's groups (batch_std's one std)
                rewards_P_G, parts, every_rollout = self._all_ranks(rewards_B, parts, rollouts_B)
                adv_B = world.shard(grpo.group_advantages(rewards_P_G, cfg.algorithm.advantage).flatten().tolist())
                adv_B = torch.tensor(adv_B, dtype=torch.float32)
                # 4. the rows (the sampled tokens, packed as opd train packs them) and their reference log-probs
                batch = collate(rollouts_B, self.pad_id)
                ref_N = self.reference_logprobs(batch) if cfg.algorithm.kl_beta > 0 else None
                # 5. clipped updates (an optimizer step whose gradient is not finite is skipped)
                terms = rl_teachers.terms(self.teachers, cfg.teachers, futures, batch, world) if futures is not None else []
                upd = self.update(batch, adv_B, ref_N, terms)
                skipped = self.nonfinite.check(step + 1, not upd["steps_skipped"],
                                               f" in {upd['steps_skipped']:.0f} of its optimizer steps")
                if skipped:
                    self.warnings.append(skipped)
                    if world.main:
                        tqdm.write(f"[opd rl] warning: {skipped}")
                if cfg.rollout.engine != "hf" or self.cluster is not None:
                    self.engine.sync_weights(self.model)
                # 6. metrics, warnings, eval, checkpoint
                metrics = self.step_metrics(rewards_P_G, parts, every_rollout, upd)
                if dynamic:
                    metrics.update(drawn)
                self.agent_sums = agentic.sums(every_rollout, self.agent_sums) if cfg.agent else None
                metrics.update({"time/rollout": t_rollout, "time/reward": t_reward,
                                "time/step": time.time() - t0})
                self.warn_if_flat(step, metrics)
                drowned = objective.drowned(metrics.get("signal/reward", 0.0), metrics.get("signal/teacher", 0.0),
                                            cfg.run.drown_factor) if terms else None
                if drowned and step - self.last_drowned >= 10:
                    self.last_drowned = step
                    self.warnings.append(f"step {step + 1}: {drowned}")
                    if world.main:
                        tqdm.write(f"[opd rl] warning: step {step + 1}: {drowned}")
                done = step + 1
                if self.eval_samples and cfg.run.eval_every and done % cfg.run.eval_every == 0 \
                        and done != cfg.run.steps:
                    metrics.update(self.evaluate(done))
                if done == cfg.run.steps and self.eval_samples:
                    metrics.update(self.evaluate(done))
                logger.log(done, metrics)
                history.append({"step": done, **metrics})
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", flat=f"{metrics['groups/all_equal']:.2f}",
                                kl=f"{metrics['kl']:.4f}")
                if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == cfg.run.steps:
                    self.run_dir.save(done, self.model, self.optimizer, self.scheduler, keep=cfg.run.keep_checkpoints,
                                      state={"data": self.data.state(), "warnings": self.warnings,
                                             "last_flat_warning": self.last_flat_warning, "resumes": self.resumes,
                                             "agent": self.agent_sums})
        finally:
            bar.close()
            logger.close()
            self.engine.close()
            if self.teachers is not None:
                self.teachers.close()
            self.close_cluster()
        self.memory = memory_per_rank(self.model, self.optimizer)
        self.run_dir.finish(self.model, self.tokenizer, PLOT_GROUPS, cfg.model)   # RUN/model: LoRA merged in
        summary = summarize(history)
        if world.main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            self.write_card(history)
        return summary

    def sample(self, step: int, draw: int = 0) -> tuple[list, list]:
        """(P prompts, their P x G rollouts) from the current policy, this rank's share of them;
        `draw` > 0: a further draw of dynamic sampling, with its own numbers."""
        cfg, P, G, world = self.cfg, self.cfg.rollout.prompts_per_step, self.cfg.rollout.samples_per_prompt, self.world
        samples_P = world.shard(self.data.take(P))
        # A rank draws the numbers one process would draw for its rows of the whole batch.
        share = (world.rank * len(samples_P) * G, P * G) if world.sharded else None
        seed = cfg.run.seed * 1_000_003 + step + draw * 7_919_993
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=cfg.rollout.max_new_tokens, n=G, seed=seed, share=share)
        return samples_P, self.engine.generate([self.encode(s) for s in samples_P], params)

    def rewards_of(self, samples_P: list, rollouts_B: list) -> tuple[list[float], dict[str, list[float]]]:
        """Each rollout's reward (with agent_shaping's terms) and the reward's parts."""
        texts_B = [self.decode(r) for r in rollouts_B]
        samples_B = [samples_P[r.prompt_index] for r in rollouts_B]
        trajs = [trajectory(r, self.tokenizer) for r in rollouts_B] if self.cfg.agent else None
        return agentic.shaped(self.cfg, self.reward(samples_B, texts_B, trajs), rollouts_B)

    def _all_ranks(self, rewards_B: list[float], parts: dict[str, list[float]], rollouts_B: list):
        """The step's rewards [P, G], reward parts and rollouts of every rank, in prompt order
        (each rank scored whole groups of its share of the prompts)."""
        G = self.cfg.rollout.samples_per_prompt
        if not self.world.sharded:
            return torch.tensor(rewards_B, dtype=torch.float32).view(-1, G), parts, rollouts_B
        ranks = self.world.gather((rewards_B, parts, rollouts_B))
        rewards = [r for part, _, _ in ranks for r in part]
        merged = {k: [v for _, p, _ in ranks for v in p[k]] for k in parts}
        return torch.tensor(rewards, dtype=torch.float32).view(-1, G), merged, [ro for *_, ros in ranks for ro in ros]

    # -- Ray ---------------------------------------------------------------------------------

    def start_ray_engine(self):
        """Join (or start) Ray and start the rollout actors; a resumed run pushes its weights to them."""
        import ray   # optional, and about a second to import: only cluster.mode ray needs it

        r = self.cfg.rollout
        self._ray_started = not ray.is_initialized()   # a Ray session this run opened is closed by it
        pool = None
        try:
            self.cluster = RayCluster.start(self.cfg.cluster, start_teachers=False)
            pool = self.cluster.rollout_pool(self.cfg.model.path, r.actors, num_cpus_per_worker=r.actor_cpus,
                                             num_gpus_per_worker=r.actor_gpus, batch_size=r.batch_size,
                                             dtype=self.cfg.model.dtype)
            engine = PoolEngine(pool, self.out / "rollout_weights.safetensors")
            if self.start_step:   # the actors loaded model.path; the policy is the checkpoint's
                engine.sync_weights(self.model)
            return engine
        except BaseException:
            if pool is not None:
                pool.shutdown()
            if self.cluster is None and self._ray_started:
                ray.shutdown()
            self.close_cluster()
            raise

    def close_cluster(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown(disconnect=self._ray_started)
            self.cluster = None

    # -- step pieces -----------------------------------------------------------------------

    def encode(self, sample) -> list[int]:
        return encode_prompt(self.tokenizer, sample.chat, tools=self.tools.schemas() if self.tools else None)

    def decode(self, rollout) -> str:
        return rollout.text(self.tokenizer)   # a trajectory's final answer: its last turn

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutRows) -> torch.Tensor:
        """[N]: the reference model's log-probs of the batch's rows (the base weights under LoRA)."""
        out = []
        mb = self.cfg.algorithm.micro_batch_size
        for i in range(0, len(batch.seq_B), mb):
            part = batch.sequences(slice(i, i + mb))
            if self.is_lora:
                with self.model.disable_adapter():  # the base weights are the reference
                    lp, _ = token_logprobs_and_entropy(self.model, part.packed, with_entropy=False)
            else:
                lp, _ = token_logprobs_and_entropy(self.reference, part.packed, with_entropy=False)
            out.append(lp.cpu())
        return torch.cat(out)

    def update(self, batch: RolloutRows, adv_B: torch.Tensor, ref_N: torch.Tensor | None,
               terms: list[TeacherTerm] = ()) -> dict:
        """`epochs` passes, each split into `minibatches` optimizer steps of micro-batches.
        adv_B: each sequence's advantage; ref_N: the reference's log-probs of the rows (None: no
        KL term); terms: the teachers' log-probs; each token's advantage gains their reverse-KL terms."""
        a = self.cfg.algorithm
        B = adv_B.shape[0]
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "ratio": 0.0,
                "grad_norm": 0.0}
        n_tok_total, n_steps, skipped = 0.0, 0, 0
        self.model.train()
        for _epoch in range(a.epochs):
            order = torch.randperm(B) if a.minibatches > 1 else torch.arange(B)
            # Exactly `minibatches` parts, sizes differing by at most one: chunks of ceil(B / m)
            # rows gave fewer steps than promised (B=16, m=12: 8). The config keeps m <= B.
            for seqs in torch.tensor_split(order, a.minibatches):
                mini = batch.sequences(seqs)
                # Normalizers over every rank's share of the minibatch: the ranks' gradients sum to one
                # process's over the whole of it.
                counts = self.world.sum({"seq": float(len(seqs)), "tok": float(len(mini.index_N))})
                n_seq, n_tok = int(counts["seq"]), counts["tok"]
                # every rank runs as many micro-batches as the largest share needs (empty ones too):
                # a sharded model's passes are collectives
                for u0 in range(0, n_seq, a.micro_batch_size):
                    part = mini.sequences(slice(u0, u0 + a.micro_batch_size))
                    # Log-probs and entropy from the hidden states in vocabulary chunks (rl/logprobs.py):
                    # nothing of size [rows, V] (unless a term trains the entropy).
                    lp, ent = token_logprobs_and_entropy(self.model, part.packed,
                                                         entropy_grad=self.cfg.terms.needs_entropy)
                    dev = lp.device
                    old = part.old_logprobs_N.to(dev)
                    adv = part.per_row(adv_B[part.seq_B]).to(dev)
                    if terms:   # per token: the reward's advantage plus each teacher's (opd.spine.objective)
                        adv, signal = rl_teachers.token_advantages(adv, lp, part, terms)
                        for k, v in signal.items():
                            sums[k] = sums.get(k, 0.0) + v
                    pg_N, clipped_N = grpo.clipped_surrogate(lp, old, adv, a.eps_low, a.eps_high)
                    agg = dict(num_sequences=n_seq, num_tokens=n_tok, max_tokens=agentic.sampled_budget(self.cfg))
                    lengths = part.lengths
                    pg = grpo.aggregate(pg_N, lengths, a.loss_aggregation, **agg)
                    loss = pg
                    extra_N = term_loss(self.cfg.terms, entropy=ent)   # opd.spine.terms
                    if extra_N is not None:
                        loss = loss + grpo.aggregate(extra_N, lengths, a.loss_aggregation, **agg)
                    if ref_N is not None:
                        kl_N = grpo.kl_to_reference(lp, ref_N[part.index_N].to(dev), a.kl_estimator)
                        loss = loss + a.kl_beta * grpo.aggregate(kl_N, lengths, a.loss_aggregation, **agg)
                    else:
                        with torch.no_grad():  # tracked against the rollout policy when no reference
                            kl_N = grpo.kl_to_reference(lp.detach(), old, "k3")
                    loss.backward()
                    with torch.no_grad():
                        n_tok_total += len(lp)
                        sums["kl"] += float(kl_N.detach().sum())
                        sums["clip_fraction"] += float(clipped_N.float().sum())
                        sums["entropy"] += float(ent.detach().sum())
                        sums["ratio"] += float(torch.exp(lp.detach() - old).sum())
                        sums["loss"] += float(loss.detach())
                        sums["pg_loss"] += float(pg.detach())
                norm, applied = optimizer_step(self.optimizer, self.params, self.cfg.optim.grad_clip)
                sums["grad_norm"] += norm
                skipped += not applied
                n_steps += 1
        lr = self.optimizer.param_groups[0]["lr"]   # the rate these updates used, not the next step's
        self.scheduler.step()
        # Every rank's tokens; the losses (already parts of the global ones) summed over the ranks.
        totals = self.world.sum({"tok": n_tok_total, **{k: v for k, v in sums.items() if k != "grad_norm"}})
        n_tok_total = totals.pop("tok")
        sums.update(totals)
        per_tok = max(n_tok_total, 1.0)
        return {"loss": sums["loss"] / n_steps, "loss/pg": sums["pg_loss"] / n_steps,
                "kl": sums["kl"] / per_tok, "clip_fraction": sums["clip_fraction"] / per_tok,
                "entropy": sums["entropy"] / per_tok, "ratio/mean": sums["ratio"] / per_tok,
                "grad_norm": sums["grad_norm"] / n_steps, "lr": lr, "steps_skipped": float(skipped),
                **{k: sums[k] / per_tok for k in ("signal/reward", "signal/teacher") if k in sums}}

    def step_metrics(self, rewards_P_G: torch.Tensor, parts: dict, rollouts_B, upd: dict) -> dict:
        flat_P = grpo.equal_groups(rewards_P_G)
        verdict = verifier_verdict(parts, rewards_P_G.shape)
        lengths = torch.tensor([len(r.response_ids) for r in rollouts_B], dtype=torch.float32)
        m = {"reward/mean": float(rewards_P_G.mean()),
             "reward/group_std": float(rewards_P_G.std(dim=1).mean()) if rewards_P_G.shape[1] > 1 else 0.0,
             "groups/all_equal": float(flat_P.float().mean()),
             "length/mean": float(lengths.mean()), "length/max": float(lengths.max()),
             "length/truncated": float(sum(r.finish_reason == "length" for r in rollouts_B) / len(rollouts_B))}
        if verdict is not None:   # flat groups the verifier scores all correct / all wrong
            correct_P_G, wrong_P_G = verdict
            m["groups/all_top"] = float((flat_P & correct_P_G.all(dim=1)).float().mean())
            m["groups/all_bottom"] = float((flat_P & wrong_P_G.all(dim=1)).float().mean())
        for name, vals in parts.items():
            m[f"reward/{name}"] = sum(vals) / len(vals)
        m.update(agentic.step_metrics(rollouts_B))   # multi-turn: turns, tool calls, masked observations
        m.update(upd)
        return m

    def warn_if_flat(self, step: int, m: dict) -> None:
        share = m["groups/all_equal"]
        if share <= self.cfg.run.flat_warning or step - self.last_flat_warning < 10:
            return
        self.last_flat_warning = step
        # Correct / wrong as the verifier says, not the batch's best / worst reward: with a
        # format bonus, a batch of well-formatted wrong answers is flat at its own maximum.
        top, bottom = m.get("groups/all_top", 0.0), m.get("groups/all_bottom", 0.0)
        counts = f"{top:.0%} of groups are all-correct and {bottom:.0%} all-wrong by the verifier"
        if top >= bottom and top > 0:
            why = f"{counts}: the data are too easy for this model"
        elif bottom > 0:
            why = f"{counts}: the data are too hard for this model (or the answer format is unknown to it)"
        elif "groups/all_top" in m:
            why = f"{counts} (the responses of a group get the same partial score or shaping reward)"
        else:
            why = "responses in a group get identical rewards"
        text = (f"warning at step {step + 1}: {share:.0%} of groups got the same reward for all "
                f"{self.cfg.rollout.samples_per_prompt} responses and carry no gradient; {why}, or the temperature "
                f"({self.cfg.rollout.temperature}) is too low for responses to differ. Reward will stay flat.")
        self.warnings.append(text)   # for the card
        if self.world.main:
            tqdm.write(f"[opd rl] {text}")

    @torch.no_grad()
    def evaluate(self, step: int | None = None) -> dict:
        """The held-out evaluation (rl/evaluate.py); a hidden-test warning goes to the card."""
        out = evaluate(self, step or 0)
        if "warning" in out:
            text = f"step {step}: {out.pop('warning')}" if step is not None else out.pop("warning")
            self.warnings.append(text)
            if self.world.main:
                tqdm.write(f"[opd rl] warning: {text}")
        return out

    # -- outputs ---------------------------------------------------------------------------

    def write_card(self, history: list[dict] | None = None) -> None:
        """card.md / card.json (opd.rl.card): the settings, the resumes, and with `history` (every
        step's metrics, the steps before a resume included) the results; without it, at the
        start, the results section says the run is in progress."""
        write_grpo_card(self.out, self.cfg, reward=self.reward.describe(), train_report=self.train_report,
                        resumes=self.resumes, warnings=self.warnings, start_step=self.start_step, history=history,
                        ranks=self.world.size, memory=self.memory,
                        agent=agentic.facts(self.cfg, self.agent_sums) if self.cfg.agent else None)
