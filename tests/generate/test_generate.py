"""opd generate: a teacher's samples, filtered by the verifier and deduplicated, as opd sft data."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from opd.cli import main
from opd.data import load_jsonl, write_jsonl

# The stub endpoint's answers, per prompt: "4" twice (one a duplicate once whitespace is set
# aside), a wrong "5", and for the code prompt one passing and one failing function.
CHOICES = {
    "2+2=": ["4", " 4 ", "5"],
    "Write f(x) returning x+1.": ["```python\ndef f(x):\n    return x + 1\n```", "def f(x):\n    return x",
                                  "```python\ndef f(x):\n    return x + 1\n```"],
    "Say hi.": ["hi", "hello", "hi"],
}


class Endpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible /v1/chat/completions that answers from CHOICES (n of them) and
    records each request body."""
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Endpoint.seen.append({**body, "auth": self.headers.get("Authorization")})
        if body["model"] in ("garbage", "slow"):   # a body that is not JSON; an answer after the timeout
            if body["model"] == "slow":
                time.sleep(2)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>502 bad gateway</html>")
            return
        if self.path != "/v1/chat/completions" or body["model"] != "teacher-7b":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": "no such model"}')
            return
        texts = CHOICES[body["messages"][-1]["content"]][:body["n"]]
        out = {"choices": [{"index": i, "message": {"role": "assistant", "content": t}} for i, t in enumerate(texts)],
               "usage": {"completion_tokens": 2 * len(texts)}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Endpoint.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def prompts(tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "2+2=", "domain": "math", "answer": "4"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write f(x) returning x+1."}],
         "domain": "code", "tests": "assert f(1) == 2\nassert f(5) == 6"},
        {"prompt": "Say hi.", "domain": "chat"},
    ])


def config(tmp_path, url, **extra) -> str:
    lines = ["teacher: {engine: http, url: %s, api_model: teacher-7b, api_key_env: OPD_TEST_KEY}" % url,
             "prompts: prompts.jsonl", "out: samples.jsonl", "sampling: {n: 3, max_new_tokens: 32}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    (tmp_path / "gen.yaml").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "gen.yaml")


def test_rejection_sampling_from_an_endpoint_keeps_the_correct_distinct_answers(tmp_path, endpoint, monkeypatch,
                                                                                capsys):
    monkeypatch.setenv("OPD_TEST_KEY", "sk-test")
    prompts(tmp_path)
    assert main(["generate", config(tmp_path, endpoint)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    # math: "4" kept, " 4 " a duplicate, "5" wrong; code: the passing function once (its copy is a
    # duplicate), the failing one wrong; chat has no verifier: kept unverified, "hi" once.
    assert [(r.get("prompt"), r.get("response")) for r in rows[:1]] == [("2+2=", "4")]
    assert rows[1]["messages"][:2] == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Write f(x) returning x+1."}]
    assert rows[1]["messages"][2] == {"role": "assistant", "content": CHOICES["Write f(x) returning x+1."][0]}
    assert [r["response"] for r in rows[2:]] == ["hi", "hello"] and rows[2]["score"] is None
    assert rows[0]["score"] == 1.0 and rows[1]["tests"].startswith("assert")
    card = json.loads((tmp_path / "samples.card.json").read_text())
    assert (card["rows"], card["responses_sampled"], card["dropped_wrong"], card["dropped_duplicate"],
            card["kept_unverified"], card["prompts_with_none_kept"]) == (4, 9, 2, 3, 3, 0)
    assert card["pass_rate"] == {"code": 2 / 3, "math": 2 / 3}
    assert card["tokens_sampled"] == 18
    assert "4 of 9" in (tmp_path / "samples.card.md").read_text()
    # What went over the wire: the conversation, n, the sampling settings, the key.
    sent = {s["messages"][-1]["content"]: s for s in Endpoint.seen}
    assert sent["Write f(x) returning x+1."]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert sent["2+2="]["n"] == 3 and sent["2+2="]["max_tokens"] == 32 and sent["2+2="]["auth"] == "Bearer sk-test"
    # opd sft reads it as it is: prompt/response rows and a conversation whose last turn is the response.
    samples, _ = load_jsonl(tmp_path / "samples.jsonl")
    assert samples[1].response == CHOICES["Write f(x) returning x+1."][0] and samples[1].messages[-1]["role"] == "user"
    # An existing output is not replaced without --overwrite, and nothing is sampled.
    before = len(Endpoint.seen)
    assert main(["generate", config(tmp_path, endpoint)]) == 1
    assert "--overwrite" in capsys.readouterr().err and len(Endpoint.seen) == before
    # keep: all, at most one per prompt, every row a conversation.
    assert main(["generate", config(tmp_path, endpoint, filter="{keep: all, max_per_prompt: 1}", format="messages"),
                 "--overwrite"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["messages"][-1]["content"] for r in rows] == ["4", CHOICES["Write f(x) returning x+1."][0], "hi"]
    assert all("prompt" not in r for r in rows)


def test_an_endpoint_error_and_a_bad_config_are_clear(tmp_path, endpoint, capsys):
    prompts(tmp_path)
    (tmp_path / "bad.yaml").write_text("teacher: {engine: http, url: %s, api_model: other}\nprompts: prompts.jsonl\n"
                                       "out: x.jsonl\n" % endpoint)
    assert main(["generate", str(tmp_path / "bad.yaml")]) == 1
    assert "answered HTTP 404" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    for model, says in (("garbage", "not a chat completion: b'<html>502"), ("slow", "within teacher.timeout_s = 1.0")):
        (tmp_path / "bad.yaml").write_text("teacher: {engine: http, url: %s, api_model: %s, timeout_s: 1}\n"
                                           "prompts: prompts.jsonl\nout: x.jsonl\n" % (endpoint, model))
        assert main(["generate", str(tmp_path / "bad.yaml")]) == 1
        assert says in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    (tmp_path / "bad.yaml").write_text("teacher: {engine: http}\nprompts: prompts.jsonl\nout: x.jsonl\n")
    assert main(["generate", str(tmp_path / "bad.yaml")]) == 2
    assert "teacher.url" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("teacher: {model: m}\nprompts: prompts.jsonl\nout: x.jsonl\nsampling: {k: 1}\n")
    assert main(["generate", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml:4" in capsys.readouterr().err


def test_a_local_model_samples_reproducibly_and_opd_sft_trains_on_its_output(tmp_path, tiny_model_dir):
    from opd.config import load_yaml
    from opd.generate.config import GenerateConfig
    from opd.generate.sample import generate

    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)])
    (tmp_path / "gen.yaml").write_text(
        f"teacher: {{model: {tiny_model_dir}, device: cpu}}\nprompts: prompts.jsonl\nout: a.jsonl\n"
        "sampling: {n: 2, max_new_tokens: 6, batch_size: 4, seed: 3}\nfilter: {keep: all, dedup: false}\n")
    cfg = load_yaml(tmp_path / "gen.yaml", GenerateConfig)
    card = generate(cfg, tmp_path / "gen.yaml")
    first = (tmp_path / "a.jsonl").read_text()
    assert card["rows"] == card["responses_sampled"] == 12 and 12 <= card["tokens_sampled"] <= 72
    assert card["pass_rate"]["all"] < 1.0   # the random tiny model: scored, kept anyway (keep: all)
    generate(cfg, tmp_path / "gen.yaml", overwrite=True)
    assert (tmp_path / "a.jsonl").read_text() == first   # the same seed, the same samples
    rows = [json.loads(line) for line in first.splitlines()]
    assert [r["prompt"] for r in rows] == [f"{a}+1=" for a in range(6) for _ in range(2)]
    (tmp_path / "sft.yaml").write_text(f"model: {{path: {tiny_model_dir}, device: cpu}}\n"
                                       "data: {train: [{path: a.jsonl}], batch_size: 4}\n"
                                       "run: {out_dir: run, steps: 2, threads: 1}\n")
    assert main(["sft", str(tmp_path / "sft.yaml")]) == 0
    assert (tmp_path / "run" / "model" / "config.json").is_file()


@pytest.mark.vllm
def test_the_vllm_engine_answers_n_per_prompt_as_a_local_source(vllm_rollout_engine, vllm_model_dir, tmp_path):
    pytest.importorskip("vllm")
    from opd.config import load_yaml
    from opd.data import Sample
    from opd.generate.config import GenerateConfig, Sampling
    from opd.generate.sample import LocalSource, generate
    from opd.rollout import SamplingParams
    from opd.spine.model import load_tokenizer

    source = LocalSource(vllm_rollout_engine, load_tokenizer(vllm_model_dir), Sampling(n=3, max_new_tokens=5))
    answers = source.answer([Sample(prompt="ab"), Sample(prompt="cd")])
    assert [len(a) for a in answers] == [3, 3]
    assert all(isinstance(text, str) and 1 <= n <= 5 for a in answers for text, n in a)
    # The whole command's path over it (the session's engine is left open), and opd sft's reading.
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(4)])
    (tmp_path / "gen.yaml").write_text(f"teacher: {{engine: vllm, model: {vllm_model_dir}}}\nprompts: p.jsonl\n"
                                       "out: v.jsonl\nsampling: {n: 2, max_new_tokens: 5}\nfilter: {keep: all}\n")
    cfg = load_yaml(tmp_path / "gen.yaml", GenerateConfig)
    source = LocalSource(vllm_rollout_engine, load_tokenizer(vllm_model_dir), cfg.sampling)
    card = generate(cfg, tmp_path / "gen.yaml", source=source)
    assert card["responses_sampled"] == 8 and card["teacher"]["engine"] == "vllm"
    assert len(load_jsonl(tmp_path / "v.jsonl")[0]) == card["rows"]
    assert vllm_rollout_engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))   # still open


def test_a_served_teacher_answers_as_the_same_model_sampled_here(tmp_path, tiny_teacher_dir, tiny_model_dir):
    # Greedy answers of the served teacher (protocol 2.7) are those of the same model in this
    # process; a server whose tokenizer differs from teacher.model's is refused before sampling.
    from opd.config import load_yaml
    from opd.generate.config import GenerateConfig
    from opd.generate.sample import EndpointError, generate
    from opd.teachers.hf_backend import HFBackend
    from opd.teachers.server import serving_in_thread

    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(5)])
    same = "sampling: {n: 1, temperature: 0.0, max_new_tokens: 6, batch_size: 2}\nfilter: {keep: all, dedup: false}\n"
    (tmp_path / "here.yaml").write_text(f"teacher: {{model: {tiny_teacher_dir}, device: cpu}}\nprompts: prompts.jsonl\n"
                                        f"out: here.jsonl\n{same}")
    generate(load_yaml(tmp_path / "here.yaml", GenerateConfig), tmp_path / "here.yaml")
    with serving_in_thread(HFBackend(tiny_teacher_dir, max_k=8)) as server:
        (tmp_path / "served.yaml").write_text(
            f"teacher: {{engine: served, address: '{server.address}', model: {tiny_teacher_dir}}}\n"
            f"prompts: prompts.jsonl\nout: served.jsonl\n{same}")
        card = generate(load_yaml(tmp_path / "served.yaml", GenerateConfig), tmp_path / "served.yaml")
        assert card["rows"] == 5 and card["teacher"]["engine"] == "served"
        assert (tmp_path / "served.jsonl").read_text() == (tmp_path / "here.jsonl").read_text()
        # The tiny student's byte tokenizer is the teacher's too; a chat tokenizer is another.
        from opd.tiny import build_tiny_model
        chat = build_tiny_model(tmp_path / "chat", seed=0, chat=True)
        (tmp_path / "other.yaml").write_text(f"teacher: {{engine: served, address: '{server.address}', model: {chat}}}\n"
                                             f"prompts: prompts.jsonl\nout: other.jsonl\n{same}")
        with pytest.raises(EndpointError, match="another tokenizer"):
            generate(load_yaml(tmp_path / "other.yaml", GenerateConfig), tmp_path / "other.yaml")
    assert not (tmp_path / "other.jsonl").exists()
