"""Multi-turn trajectories' rows, by hand: which response tokens are trained (pack's rows),
which are scored (the row mask a teacher is sent), and which are context only (tool
observations, a turn's tokens after its answer's end)."""

import pytest
import torch

from opd.data import Sample
from opd.distill.batch import Batch, trimmed
from opd.distill.context import teacher_inputs
from opd.rollout.base import Rollout
from opd.routing.router import Route
from opd.spine.rows import pack, trim_length, trim_turns
from opd.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("chat_tok"), chat=True)   # bytes: one token each


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _trim(tok, how, marker="</a>"):
    return lambda ids: trim_length(ids, eos_ids={tok.eos_token_id}, trim=how, marker=marker, tokenizer=tok)


def _trajectory(tok, turn1="<c>", turn2="5</a>z"):
    """prompt "Q:" (2 tokens); turn 1 `turn1` + EOS (a tool call); the observation "\\nt5\\n" (4
    tokens, not sampled); turn 2 `turn2` + EOS (the answer)."""
    eos = tok.eos_token_id
    t1, obs, t2 = _ids(tok, turn1) + [eos], _ids(tok, "\nt5\n"), _ids(tok, turn2) + [eos]
    response = t1 + obs + t2
    mask = [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
    lp = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    topk = [[i, i + 1] if m else [] for i, m in enumerate(mask)]
    return Rollout(prompt_ids=_ids(tok, "Q:"), response_ids=response, logprobs=lp, finish_reason="eos",
                   mask=mask, topk_ids=topk)


T, F = True, False


def test_two_turns_trimmed_at_eos_train_and_score_both_turns_and_not_the_observation(tok):
    ro = _trajectory(tok)                    # response: 0-3 turn 1, 4-7 observation, 8-14 turn 2
    assert len(ro.response_ids) == 15
    keep, mask = trim_turns(ro, _trim(tok, "eos"))
    assert keep == 15
    assert mask == [T] * 4 + [F] * 4 + [T] * 7
    p = pack([ro.prompt_ids], [ro.response_ids[:keep]], pad_id=0, masks=[mask])
    # row i of the response is predicted at position len(prompt) - 1 + i = 1 + i
    assert p.row_pos_N.tolist() == [1, 2, 3, 4] + [9, 10, 11, 12, 13, 14, 15]
    assert p.targets_N.tolist() == ro.response_ids[0:4] + ro.response_ids[8:15]
    assert p.row_offsets == [0, 11]
    # every token is in the input (the observation is context): 2 prompt + 15 response
    assert p.input_ids_B_L[0].tolist() == ro.prompt_ids + ro.response_ids


def test_the_answer_marker_ends_the_last_turn_and_what_follows_it_is_not_sent(tok):
    ro = _trajectory(tok)                    # turn 2 is "5</a>z" + EOS: "z" and EOS come after the marker
    keep, mask = trim_turns(ro, _trim(tok, "marker"))
    assert keep == 13                        # through "5</a>" (8-12); 13-14 cut
    assert mask == [T] * 4 + [F] * 4 + [T] * 5
    p = pack([ro.prompt_ids], [ro.response_ids[:keep]], pad_id=0, masks=[mask])
    assert p.row_pos_N.tolist() == [1, 2, 3, 4] + [9, 10, 11, 12, 13]
    assert tok.decode(p.targets_N.tolist()) == "<c>" + tok.eos_token + "5</a>"


def test_a_marker_inside_an_earlier_turn_leaves_that_turns_rest_as_context(tok):
    # turn 1 "x</a><c>" + EOS: its answer ends at "</a>"; "<c>" + EOS is context for turn 2
    ro = _trajectory(tok, turn1="x</a><c>", turn2="5")
    keep, mask = trim_turns(ro, _trim(tok, "marker"))
    assert len(ro.response_ids) == 9 + 4 + 2
    assert keep == 15
    assert mask == [T] * 5 + [F] * 4 + [F] * 4 + [T] * 2
    p = pack([ro.prompt_ids], [ro.response_ids[:keep]], pad_id=0, masks=[mask])
    assert p.row_pos_N.tolist() == [1, 2, 3, 4, 5, 14, 15]


def test_a_trailing_observation_is_never_sent():
    ro = Rollout(prompt_ids=[1], response_ids=[5, 0, 7, 8], logprobs=[-1.0, -1.0, 0.0, 0.0], finish_reason="eos",
                 mask=[1, 1, 0, 0])
    assert trim_turns(ro, lambda ids: trim_length(ids, eos_ids={0}, trim="eos")) == (2, [T, T])
    nothing = Rollout(prompt_ids=[1], response_ids=[7, 8], logprobs=[0.0, 0.0], finish_reason="length", mask=[0, 0])
    assert trim_turns(nothing, lambda ids: len(ids)) == (0, [])


@pytest.mark.parametrize("how", ["none", "eos", "marker"])
def test_a_single_turn_trims_exactly_as_trim_length(tok, how):
    ids = _ids(tok, "x=4</a> and") + [tok.eos_token_id] + _ids(tok, "more")
    trim = _trim(tok, how)
    plain = Rollout(prompt_ids=[1], response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="length")
    assert trim_turns(plain, trim) == (trim_length(ids, eos_ids={tok.eos_token_id}, trim=how, marker="</a>",
                                                   tokenizer=tok), None)
    one = Rollout(prompt_ids=[1], response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="length",
                  mask=[1] * len(ids))   # the agent loop's one-turn trajectory: the same keep, all rows
    keep, mask = trim_turns(one, trim)
    assert keep == trim_turns(plain, trim)[0] and mask == [T] * keep


def test_pack_refuses_a_mask_of_another_length():
    with pytest.raises(ValueError, match="row mask of 2 for 3"):
        pack([[1]], [[2, 3, 4]], pad_id=0, masks=[[T, F]])


def _batch(rollouts, keep, masks):
    route = Route(domain="d", weights={"t": 1.0}, teacher="t", rule="test", reason="test")
    return Batch(index=0, samples=[Sample(prompt="Q:")], routes=[route], rollouts=rollouts, keep=keep, masks=masks,
                 policy_version=0)


def test_the_batch_sends_the_teacher_the_kept_trajectory_and_its_row_mask(tok):
    ro = _trajectory(tok)
    single = Rollout(prompt_ids=[1, 2], response_ids=[70, 71, tok.eos_token_id, 72], logprobs=[-1.0, -2.0, -3.0, -4.0],
                     finish_reason="length", topk_ids=[[1, 2], [3, 4], [5, 6], [7, 8]])
    keep, masks = trimmed([ro, single], _trim(tok, "marker"))
    assert keep == [13, 3] and masks == [[T] * 4 + [F] * 4 + [T] * 5, None]
    batch = _batch([ro, single], keep, masks)
    (sequences, starts, rows), = batch.requests().values()
    assert sequences == [ro.prompt_ids + ro.response_ids[:13], single.prompt_ids + single.response_ids[:3]]
    assert starts == [2, 2]
    assert rows == [[T] * 4 + [F] * 4 + [T] * 5, [T] * 3]      # scored: the model's own kept tokens
    assert [batch.rows(s) for s in (0, 1)] == [9, 3]
    # the sampler's log-probs and the student_topk candidates of the rows alone, in order
    assert batch.sampler_logprobs(0) == [ro.logprobs[i] for i in (0, 1, 2, 3, 8, 9, 10, 11, 12)]
    assert batch.sampler_logprobs(1) == [-1.0, -2.0, -3.0]
    spec = type("Spec", (), {"context": None, "mode": "student_topk", "k": 2, "name": "t"})()
    cand = teacher_inputs(spec, tok, [None, None], [ro, single], keep, rows)["candidates"]
    assert cand.tolist() == [[i, i + 1] for i in (0, 1, 2, 3, 8, 9, 10, 11, 12)] + [[1, 2], [3, 4], [5, 6]]
    # the student trains the same rows
    p = pack([ro.prompt_ids, single.prompt_ids], batch.responses(), pad_id=0, masks=[batch.row_mask(0),
                                                                                      batch.row_mask(1)])
    assert p.row_offsets == [0, 9, 12]
    assert p.targets_N.tolist() == [ro.response_ids[i] for i in (0, 1, 2, 3, 8, 9, 10, 11, 12)] + [70, 71,
                                                                                                  tok.eos_token_id]
    state = Batch.from_state(batch.to_state())   # a look-ahead batch in a checkpoint keeps its masks
    assert state.masks == masks and state.rollouts[0].mask == ro.mask


def test_single_turn_batches_send_no_row_mask(tok):
    single = Rollout(prompt_ids=[1], response_ids=[5, tok.eos_token_id, 6], logprobs=[-1.0] * 3, finish_reason="length")
    keep, masks = trimmed([single], _trim(tok, "eos"))
    assert (keep, masks) == ([2], None)
    (_, _, rows), = _batch([single], keep, masks).requests().values()
    assert rows is None
