"""`python scripts/demo.py --agentic`: the demo's agentic stage, a task where the tool matters.

Products of a 3-digit and a 4-digit number ("417*3829=" -> "1596693", opd/tiny/agentic.py):
too large for a tiny byte-level model to compute, easy with the calculator tool, whose answer
it only has to copy. Every step runs the real CLI command in a subprocess, on a config written
to OUT/configs/ from configs/demo/agentic_*.yaml, cached like the other stages (scripts/demo.py):

    a0 data        teacher rows (call the tool, then copy its answer), student rows (answer
                   directly), prompt rows for RL / distillation, held-out prompts
    a1 teacher     `opd sft` on the teacher rows, the calculator's schema in every prompt
    a2 teacher RL  `opd rl` with `agent:`: a short GRPO pass over multi-turn trajectories
    a3 student     `opd sft` on the direct answers: the format, not the skill
    a4 distill     `opd serve-teacher` (the teacher after RL) + `opd train` with `agent:`: the
                   student's rollouts call the calculator; the teacher scores its turns
    a5 evaluate    `opd validate` twice on the held-out prompts: WITH the tool (`agent:`,
                   calls executed) and WITHOUT it (one turn, no tools in the prompt)
    report         OUT/agentic/report.md: held-out accuracy and tool calls of the student's
                   start, the student after distillation, the teacher before and after RL

It runs alone (the recipe's stages are independent of it) and the teacher is served on the
first of --ports.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml

from opd.tiny.agentic import write_agentic_data

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "configs" / "demo"
FULL_DATA = {"n_sft": 2000, "n_train": 1000, "n_eval": 100, "digits": [3, 4], "seed": 0}
QUICK = {
    "data": {"n_sft": 40, "n_train": 24, "n_eval": 6},
    "agentic_teacher_sft": {"run.steps": 6, "data.batch_size": 4},
    "agentic_rl": {"run.steps": 1, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "data.eval_prompts": 2,
                   "run.eval_every": 0},
    "agentic_student_sft": {"run.steps": 4, "data.batch_size": 4},
    "agentic_train": {"run.steps": 2, "rollout.prompts_per_step": 2, "run.eval_prompts": 2, "run.eval_every": 0},
    "agentic_validate": {"limit": 6},
}
# Where each config keeps its training seed (`--seed` sets them; the data stay FULL_DATA's).
SEED_KEYS = {"agentic_teacher_sft": ("run.seed", "model.tiny.seed"), "agentic_student_sft": ("run.seed",),
             "agentic_rl": ("run.seed",), "agentic_train": ("run.seed",), "agentic_validate": ("seed",)}
# The rows of the report: (validate's model name, label, its model directory under OUT/agentic, its
# validate role).
MODELS = [("student-start", "student start (SFT, direct answers)", "student_sft/model", "base"),
          ("student-after", "student after `opd train` with the tool", "train/model", "student"),
          ("teacher-sft", "teacher, SFT (before RL)", "teacher_sft/model", "other"),
          ("teacher", "teacher after `opd rl`", "teacher_rl/model", "teacher")]


class AgenticDemo:
    """The stage on a scripts/demo.py Demo (its output dir, sizes, seed, caching and children)."""

    def __init__(self, demo):
        self.demo = demo
        self.root = demo.out / "agentic"
        self.port = next(iter(demo.ports.values()))

    def config(self, name: str, overrides: dict | None = None) -> Path:
        return self.demo.config(TEMPLATES / f"{name}.yaml", name, overrides, sizes=QUICK, seed_keys=SEED_KEYS)

    # -- a0
    def data(self) -> None:
        params = {**FULL_DATA, **(QUICK["data"] if self.demo.quick else {})}
        d = self.root / "data"
        outputs = [d / f"{n}.jsonl" for n in ("teacher_sft", "student_sft", "train", "eval")]
        self.demo.stage("a0_data", [json.dumps(params), REPO / "opd" / "tiny" / "agentic.py"], outputs,
                        lambda: write_agentic_data(d, **{**params, "digits": tuple(params["digits"])}))

    # -- a1 + a2: the teacher
    def teacher(self) -> None:
        sft = self.config("agentic_teacher_sft")
        self.demo.stage("a1_teacher_sft", [sft, self.demo.keys["a0_data"]],
                        [self.root / "teacher_sft" / "model" / "config.json"],
                        lambda: self.demo.cli("agentic_teacher_sft", "sft", sft, "--overwrite", echo=False))
        rl = self.config("agentic_rl")
        self.demo.stage("a2_teacher_rl", [rl, self.demo.keys["a1_teacher_sft"]],
                        [self.root / "teacher_rl" / "model" / "config.json"],
                        lambda: self.demo.cli("agentic_rl", "rl", rl, "--overwrite", echo=False))

    # -- a3: the student's start; opd train trains OUT/agentic/student, a copy of it
    def student(self) -> None:
        cfg = self.config("agentic_student_sft")
        model = self.root / "student_sft" / "model"
        self.demo.stage("a3_student_sft", [cfg, self.demo.keys["a0_data"]], [model / "config.json"],
                        lambda: self.demo.cli("agentic_student_sft", "sft", cfg, "--overwrite", echo=False))

    # -- a4: serve the teacher, distil with the tool
    def distill(self) -> None:
        address = f"tcp://127.0.0.1:{self.port}"
        cfg = self.config("agentic_train")
        merged = yaml.safe_load(cfg.read_text())
        merged["merge"]["teachers"][0]["address"] = address
        cfg.write_text(yaml.safe_dump(merged, sort_keys=False))
        run_dir = self.root / "train"

        def serve_and_train() -> None:
            student = self.root / "student"
            shutil.rmtree(student, ignore_errors=True)
            shutil.copytree(self.root / "student_sft" / "model", student)
            self.demo.serve_and_train("agentic_train", cfg, run_dir, {"tutor": (self.root / "teacher_rl" / "model",
                                                                                self.port)})

        self.demo.stage("a4_distill", [cfg, self.demo.keys["a2_teacher_rl"], self.demo.keys["a3_student_sft"]],
                        [run_dir / "model" / "config.json"], serve_and_train)

    # -- a5: held-out accuracy with and without the tool
    def evaluate(self) -> dict[str, dict]:
        models = [{"name": name, "path": str(self.root / rel), "role": role, **({"domains": ["math"]}
                  if role == "teacher" else {})} for name, _, rel, role in MODELS]
        inputs = [self.demo.keys[k] for k in ("a1_teacher_sft", "a2_teacher_rl", "a3_student_sft", "a4_distill")]
        reports = {}
        for mode in ("tools", "no_tools"):
            overrides = {"models": models, "out_dir": str(self.root / f"validate_{mode}")}
            cfg = self.config("agentic_validate", overrides)
            if mode == "no_tools":   # one turn, no tools in the prompt: what the model answers alone
                plain = yaml.safe_load(cfg.read_text())
                plain.pop("agent")
                cfg = cfg.with_name("agentic_validate_no_tools.yaml")
                cfg.write_text(yaml.safe_dump(plain, sort_keys=False))
            report = self.root / f"validate_{mode}" / "report.json"
            self.demo.stage(f"a5_validate_{mode}", [cfg, *inputs], [report],
                            lambda cfg=cfg, mode=mode: self.demo.cli(f"agentic_validate_{mode}", "validate", cfg))
            reports[mode] = json.loads(report.read_text())["results"]
        return reports

    # -- report
    def report(self, reports: dict[str, dict]) -> Path:
        with_tool, alone = reports["tools"], reports["no_tools"]
        lines = ["# `scripts/demo.py --agentic` report", "",
                 "Held-out accuracy on products of a 3-digit and a 4-digit number (greedy answers, the math "
                 "verifier reads the final turn"
                 f"{'; --quick sizes: numbers are not meaningful' if self.demo.quick else ''}). WITH the tool: "
                 "multi-turn, the calculator's calls executed; WITHOUT: one turn, no tools in the prompt. The "
                 "sampled column and the tool calls: one trajectory a prompt at temperature 1.", "",
                 "| model | with the tool | without it | with the tool, sampled (T=1) | tool calls a trajectory |",
                 "|---|---|---|---|---|"]
        for name, label, _, _ in MODELS:
            w, a = with_tool[name]["math"], alone[name]["math"]
            lines.append(f"| {label} | {w['greedy']:.2f} | {a['greedy']:.2f} | {w['pass@1']:.2f} | "
                         f"{w.get('agent/tool_calls', 0.0):.2f} |")
        t, s0, s1 = (with_tool[n]["math"]["greedy"] for n in ("teacher", "student-start", "student-after"))
        share = f"{s1 / t:.0%} of the teacher's {t:.2f}" if t else "the teacher scores 0"
        lines += ["", f"Student with the tool: {s0:.2f} -> {s1:.2f} ({share}).", "",
                  "## Wall time per stage", "", "| stage | seconds | |", "|---|---|---|"]
        for stage, secs in self.demo.times.items():
            lines.append(f"| {stage} | {secs:.0f} | {'cached' if self.demo.cached.get(stage) else ''} |")
        total = sum(s for k, s in self.demo.times.items() if not self.demo.cached.get(k))
        lines += [f"| total (this run) | {total:.0f} | |", "", "## Training cards and examples", ""]
        runs = ("teacher_sft", "teacher_rl", "student_sft", "train", "validate_tools", "validate_no_tools")
        lines += self.demo.run_links(self.root, runs)
        example = with_tool["student-after"]["math"].get("example")
        if example:
            lines += ["", f"The student after distillation, first held-out prompt `{example['prompt']}`: final turn "
                      f"`{example['answer']}`."]
        return self.demo.write_report(self.root / "report.md", lines)

    def run(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        try:
            self.data()
            self.teacher()
            self.student()
            self.distill()
            path = self.report(self.evaluate())
        finally:
            self.demo.stop_all()
        print(f"[demo] agentic stage: {time.time() - t0:.0f} s", flush=True)
        return path


def run_agentic(demo) -> Path:
    """The agentic stage on `demo` (a scripts/demo.py Demo); returns its report's path."""
    return AgenticDemo(demo).run()
