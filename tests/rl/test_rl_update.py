"""GRPOTrainer.update: `epochs` x `minibatches` optimizer steps, each row once per epoch."""

from types import SimpleNamespace

import pytest
import torch

from opd.config import ConfigError, from_dict, to_dict
from opd.rl.config import AlgorithmConfig, OptimConfig, RLConfig
from opd.spine.terms import TermsConfig
from opd.rl.batch import collate
from opd.rl.trainer import GRPOTrainer
from opd.rollout import Rollout
from opd.spine.dist import World


class TinyLM(torch.nn.Module):
    """Embedding + linear head with the call signature response_logits uses; records the rows
    of every forward pass."""

    def __init__(self, vocab: int = 8):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, 4), torch.nn.Linear(4, vocab)
        self.rows_seen: list[int] = []

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        self.rows_seen.append(input_ids.shape[0])
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


def _update(B: int, epochs: int, minibatches: int) -> list[int]:
    """Rows per optimizer step of one update over B rollouts."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step: list[int] = []
    opt.register_step_post_hook(lambda *_: (per_step.append(sum(model.rows_seen)), model.rows_seen.clear()))
    stub = SimpleNamespace(
        cfg=SimpleNamespace(algorithm=AlgorithmConfig(epochs=epochs, minibatches=minibatches, micro_batch_size=4),
                            optim=OptimConfig(), terms=TermsConfig(),
                            rollout=SimpleNamespace(max_new_tokens=3)),
        model=model, optimizer=opt, params=list(model.parameters()), world=World(),
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    rollouts = [Rollout([1, 2], [3, 4, 5], [-1.0, -1.0, -1.0], "length", i // 4) for i in range(B)]
    out = GRPOTrainer.update(stub, collate(rollouts, 0), torch.randn(B), None)
    assert all(torch.isfinite(torch.tensor(v)) for v in out.values())
    return per_step


@pytest.mark.parametrize("B,epochs,minibatches,sizes", [
    (16, 1, 1, [16]),
    (16, 2, 1, [16, 16]),
    (16, 1, 6, [3, 3, 3, 3, 2, 2]),           # ceil(16 / 6) = 3 gave 6 steps of 3, 3, 3, 3, 3, 1
    (16, 1, 12, [2] * 4 + [1] * 8),           # ceil(16 / 12) = 2 gave 8 steps, not 12
    (16, 2, 16, [1] * 32),
])
def test_update_takes_exactly_epochs_times_minibatches_steps(B, epochs, minibatches, sizes):
    per_step = _update(B, epochs, minibatches)
    assert len(per_step) == epochs * minibatches
    assert sorted(per_step, reverse=True) == sorted(sizes, reverse=True)
    assert sum(per_step) == epochs * B          # every row once per epoch


def test_config_refuses_more_minibatches_than_responses_per_step():
    base = {"model": {"path": "m"}, "data": {"train": "t"}, "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4}}
    assert from_dict({**base, "algorithm": {"minibatches": 8}}, RLConfig).algorithm.minibatches == 8
    with pytest.raises(ConfigError, match=r"algorithm.minibatches \(9\) is more than the 8 responses of a step "
                                          r"\(rollout.prompts_per_step 2 x rollout.samples_per_prompt 4\)"):
        from_dict({**base, "algorithm": {"minibatches": 9}}, RLConfig)


def test_the_renamed_keys_are_refused_with_their_new_names_and_old_checkpoints_compare_under_them():
    """opd rl's `rollout.group_size` and `data.prompts_per_step` are opd train's
    `rollout.samples_per_prompt` and `rollout.prompts_per_step` now: a config with the old keys
    is told where they went, and a checkpoint saved with them resumes as the same objective."""
    from opd.rl.resume import view as resume_view

    with pytest.raises(ConfigError, match=r"key 'rollout.group_size' is no longer read here: it is "
                                          r"rollout.samples_per_prompt now"):
        from_dict({"model": {"path": "m"}, "data": {"train": "t"}, "rollout": {"group_size": 4}}, RLConfig)
    with pytest.raises(ConfigError, match=r"key 'data.prompts_per_step' is no longer read here: it moved to "
                                          r"rollout.prompts_per_step"):
        from_dict({"model": {"path": "m"}, "data": {"train": "t", "prompts_per_step": 2}}, RLConfig)
    saved = {"rollout": {"group_size": 4, "temperature": 1.0}, "data": {"train": "t", "prompts_per_step": 2},
             "rewards": []}
    assert resume_view(saved) == {"rollout": {"samples_per_prompt": 4, "temperature": 1.0, "prompts_per_step": 2},
                                   "data": {"train": "t"}, "rewards": {}}
    assert saved["rollout"] == {"group_size": 4, "temperature": 1.0}      # the checkpoint's own dict untouched
    cfg = from_dict({"model": {"path": "m"}, "data": {"train": "t"},
                     "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4}}, RLConfig)
    view = resume_view(to_dict(cfg))
    assert view["rollout"]["samples_per_prompt"] == 4 and view["rollout"]["prompts_per_step"] == 2
