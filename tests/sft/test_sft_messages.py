"""opd sft on `messages` rows with tools: the prompt is the chat template's rendering of the
conversation with the tools' schemas (what an agentic rollout renders), only the final assistant
message + EOS is learnt, and a short run on such rows trains and saves a model."""

from __future__ import annotations

import json

import pytest

from opd.agent.chat import observation_ids
from opd.config import ConfigError, from_dict
from opd.data import encode_prompt, load_jsonl, write_jsonl
from opd.sft.config import SFTConfig, SFTDataset
from opd.sft.trainer import _load_sets, encode_pair, tool_schemas
from opd.tiny import build_tiny_model
from opd.tiny.agentic import call_text, teacher_rows


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = build_tiny_model(tmp_path_factory.mktemp("chat") / "m", layers=1, hidden=32, heads=1, kv_heads=1,
                         intermediate=32, chat=True)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    cfg = from_dict({"model": {"tiny": {"chat": True}},
                     "data": {"train": [{"path": "a.jsonl"}], "tools": [{"function": "calculator"}]}}, SFTConfig)
    return tool_schemas(cfg, tmp_path_factory.mktemp("cfg") / "sft.yaml")


def _rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", teacher_rows(417, 3829))
    return load_jsonl(path)[0]


def test_encode_is_the_templates_rendering_with_tools(chat_tok, schemas, tmp_path):
    assert [s["function"]["name"] for s in schemas] == ["calculator"]
    call, answer = _rows(tmp_path)
    assert call.response == call_text("417*3829") and answer.response == "1596693"
    for s in (call, answer):
        ids, labels = encode_pair(chat_tok, s.chat, s.response, 512, schemas)
        whole = s.messages + [{"role": "assistant", "content": s.response}]
        text = chat_tok.apply_chat_template(whole, tools=schemas, tokenize=False)
        # the template writes "\n" after the turn's end; the model's turn stops at its EOS
        assert chat_tok.decode(ids) + "\n" == text
        assert text.startswith("<|im_start|>system\ntools: calculator(expression)<|im_end|>\n")
        prompt = chat_tok.apply_chat_template(s.messages, tools=schemas, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert ids[:len(prompt)] == list(prompt)
        # labels: the final assistant message and EOS only; every earlier turn is context
        assert labels[:len(prompt)] == [-100] * len(prompt)
        assert labels[len(prompt):] == ids[len(prompt):]
        assert chat_tok.decode(labels[len(prompt):]) == s.response + "<|im_end|>"
        assert labels[-1] == chat_tok.eos_token_id
    # The first turn has no tool call in its prompt; the answer row's prompt holds the call and
    # the tool's answer: only "1596693" + EOS is learnt from it.
    ids, labels = encode_pair(chat_tok, answer.chat, answer.response, 512, schemas)
    assert sum(label != -100 for label in labels) == len("1596693") + 1


def test_the_answer_rows_prompt_is_what_the_agent_loop_gives(chat_tok, schemas, tmp_path):
    # After the model's first turn (the call, up to its EOS) the loop appends the observation
    # tokens (opd.agent.chat); the SFT row of the second turn must be that exact sequence.
    call, answer = _rows(tmp_path)
    first = encode_prompt(chat_tok, call.chat, tools=schemas)
    turn = chat_tok(call.response, add_special_tokens=False)["input_ids"] + [chat_tok.eos_token_id]
    obs = observation_ids(chat_tok, ["1596693"], "<|im_end|>", schemas)
    assert first + turn + obs == encode_prompt(chat_tok, answer.chat, tools=schemas)


def test_messages_rows_need_a_chat_template_and_tools_a_describable_function(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(tiny_model_dir))   # the byte tokenizer without a template
    write_jsonl(tmp_path / "rows.jsonl", teacher_rows(417, 3829))
    with pytest.raises(ConfigError, match="rows.jsonl.*chat template.*model.tiny: {chat: true}"):
        _load_sets(tmp_path / "sft.yaml", [SFTDataset(path="rows.jsonl")], plain, 256)
    (tmp_path / "bad.py").write_text("def nodoc(x):\n    return x\n")
    cfg = from_dict({"model": {"tiny": {}}, "data": {"train": [{"path": "a.jsonl"}],
                                                     "tools": [{"function": "bad.py:nodoc"}]}}, SFTConfig)
    with pytest.raises(ConfigError, match="data.tools: .*nodoc"):
        tool_schemas(cfg, tmp_path / "sft.yaml")
    with pytest.raises(ConfigError, match="data: tools: two tools are called"):
        from_dict({"model": {"tiny": {}}, "data": {"train": [{"path": "a.jsonl"}], "tools": [
            {"function": "calculator"}, {"function": "bad.py:calculator"}]}}, SFTConfig)


def test_short_sft_run_on_messages_rows_with_tools(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd.cli import main

    rows = [r for a in range(100, 116) for r in teacher_rows(a, 1000 + 7 * a)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "sft.yaml").write_text(
        "model: {tiny: {layers: 1, hidden: 32, heads: 1, kv_heads: 1, intermediate: 64, max_positions: 256, "
        "chat: true}}\ndata: {tools: [{function: calculator}], train: [{path: train.jsonl}], "
        "eval: [{path: train.jsonl, domain: tool}], batch_size: 8, max_length: 256}\n"
        "optim: {lr: 0.01, warmup_steps: 2}\nrun: {out_dir: run, steps: 60, log_every: 5, eval_every: 20, threads: 1}\n")
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss/tool"] for r in metrics if "eval_loss/tool" in r]
    assert len(evals) == 3 and evals[-1] < 0.5 * evals[0]
    model_dir = tmp_path / "run" / "model"
    assert AutoModelForCausalLM.from_pretrained(str(model_dir)).config.num_hidden_layers == 1
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.eos_token == "<|im_end|>" and "tool_call" in tok.chat_template   # the chat tokenizer travels
    card = json.loads((tmp_path / "run" / "card.json").read_text())
    assert "calculator" in json.dumps(card)


def test_the_example_config_loads_and_reads_the_demos_teacher_rows():
    from pathlib import Path

    from opd.config import load_yaml
    from opd.sft.config import resolve

    root = Path(__file__).resolve().parents[2] / "configs"
    path = root / "agentic_sft.yaml"
    cfg = load_yaml(path, SFTConfig)
    assert [t.function for t in cfg.data.tools] == ["calculator"] and cfg.model.tiny.chat and cfg.model.path is None
    data = resolve(path, cfg.data.train[0].path)
    assert data == (root.parent / "runs" / "demo" / "agentic" / "data" / "teacher_sft.jsonl").resolve()
