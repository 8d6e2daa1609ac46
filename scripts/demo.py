"""`make demo`: the whole distillation-first recipe on tiny models, with nothing downloaded.

    0 data      synthetic verifiable data: math, code, general (train + held-out)
    1 start     `opd sft`: a base model briefly trained on the mix; the student starts as a copy
    2 experts   from the base, per domain: a short `opd sft` warm-up on the domain, then `opd rl`
                (GRPO against the domain verifier): one teacher per domain
    3 serve     `opd serve-teacher` per expert on a loopback port
    4 merge     `opd train` with a multi-teacher merge config (configs/merge_math_code.yaml)
    5 validate  `opd validate` on every domain's held-out set
    6 report    a table in the terminal and in OUT/report.md

Every stage runs the real CLI command in a subprocess, on a config written to
OUT/configs/ from the templates in configs/demo/ (and configs/merge_math_code.yaml):
paths are moved under OUT, ports and --quick sizes filled in. A stage is skipped when a
previous run finished it with the same inputs (its config and everything upstream);
`--fresh` redoes everything. Teacher servers are always stopped at the end, also on
Ctrl-C, SIGTERM or a failure.

    python scripts/demo.py [--out runs/demo] [--fresh] [--quick] [--ports 5601,5602]
    python scripts/demo.py --agentic [--quick]     # the agentic stage alone (scripts/demo_agentic.py)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from opd.teachers.launch import start_server_process
from opd.tiny.data import write_demo_data

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "configs" / "demo"
MERGE_TEMPLATE = REPO / "configs" / "merge_math_code.yaml"
DEFAULT_OUT = REPO / "runs" / "demo"     # where the templates' relative paths point
DOMAINS = ("math", "code")               # the domains with an RL expert and a teacher server
DEFAULT_PORTS = {"math": 5601, "code": 5602, "general": 5603}

# --quick (the test): fewer steps and less data. Keys are dotted paths into each config.
QUICK = {
    "data": {"n_train": 300, "n_eval": 24},
    "sft_base": {"run.steps": 20, "data.batch_size": 8},
    "sft_math": {"run.steps": 5, "data.batch_size": 8},
    "sft_code": {"run.steps": 5, "data.batch_size": 8},
    "rl_math": {"run.steps": 2, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "data.eval_prompts": 4},
    "rl_code": {"run.steps": 2, "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "data.eval_prompts": 4},
    "merge": {"run.steps": 2, "run.eval_prompts": 4, "rollout.prompts_per_step": 2, "run.eval_every": 0},
    "validate": {"limit": 8},
}
FULL_DATA = {"n_train": 3000, "n_eval": 100, "seed": 0}
# The RL stage must raise held-out accuracy over its SFT warm-up by this much on at least one
# domain (full runs; with 100 held-out prompts one standard error of an accuracy near 0.5 is 0.05).
RL_GAIN_MIN = 0.1
# Where each stage's config keeps its training seed (`--seed` sets them all; the data sets,
# held-out prompts included, stay those of FULL_DATA's seed, so runs compare on one test).
SEED_KEYS = {"sft_base": ("run.seed", "model.tiny.seed"), "sft_math": ("run.seed",), "sft_code": ("run.seed",),
             "rl_math": ("run.seed",), "rl_code": ("run.seed",), "merge": ("run.seed",), "validate": ("seed",)}


class StageError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- configs


def _relocate(value, base: Path, out: Path):
    """Strings that resolve (relative to `base`) under runs/demo are moved under `out`, absolute."""
    if isinstance(value, dict):
        return {k: _relocate(v, base, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_relocate(v, base, out) for v in value]
    if isinstance(value, str) and not value.startswith(("tcp://", "ipc://")) and ("/" in value):
        p = Path(value)
        resolved = (p if p.is_absolute() else base / p).resolve()
        try:
            return str(out / resolved.relative_to(DEFAULT_OUT))
        except ValueError:
            return value
    return value


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        cfg = cfg.setdefault(key, {})
    cfg[leaf] = value


def write_config(template: Path, name: str, out: Path, quick: bool, overrides: dict | None = None,
                 seed: int | None = None, sizes: dict = QUICK, seed_keys: dict = SEED_KEYS) -> Path:
    """OUT/configs/NAME.yaml: the template with paths under OUT, quick sizes (sizes[name]),
    overrides and the training seed (None: the template's; at seed_keys[name]) applied. `limit`
    in a config with `sets` (opd validate's) is each set's."""
    cfg = _relocate(yaml.safe_load(template.read_text()), template.parent, out)
    seeds = {key: seed for key in seed_keys.get(name, ())} if seed is not None else {}
    for dotted, value in {**(sizes.get(name, {}) if quick else {}), **seeds, **(overrides or {})}.items():
        if dotted == "limit" and "sets" in cfg:
            for s in cfg["sets"]:
                s["limit"] = value
            continue
        _set(cfg, dotted, value)
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Written by scripts/demo.py from {template.relative_to(REPO)}; edit the template, not this file.\n"
    path.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- stages


class Demo:
    def __init__(self, out: Path, *, quick: bool, fresh: bool, ports: dict[str, int], seed: int | None = None):
        self.out, self.quick, self.fresh, self.ports, self.seed = out, quick, fresh, ports, seed
        self.keys: dict[str, str] = {}       # stage -> input hash
        self.times: dict[str, float] = {}    # stage -> wall seconds (of the run that produced it)
        self.cached: dict[str, bool] = {}
        self.servers: list = []
        self.children: set[subprocess.Popen] = set()
        # One torch thread per process: on a small CPU box several stage processes (teacher
        # servers and the trainer) share the cores, and oversubscribed threads spin.
        self.env = {"OMP_NUM_THREADS": "1", **os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

    def config(self, template: Path, name: str, overrides: dict | None = None, **tables) -> Path:
        """write_config for this run: its output dir, sizes and seed (tables: write_config's
        `sizes` and `seed_keys` of another stage set, scripts/demo_agentic.py's)."""
        return write_config(template, name, self.out, self.quick, overrides, self.seed, **tables)

    # -- caching
    def _stamp(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.json"

    def _key(self, stage: str, inputs: list) -> str:
        h = hashlib.sha256(stage.encode())
        for x in inputs:
            h.update((Path(x).read_text() if isinstance(x, Path) and x.is_file() else str(x)).encode())
        return h.hexdigest()[:16]

    def stage(self, name: str, inputs: list, outputs: list[Path], fn) -> None:
        """Run `fn()` unless a finished run with the same inputs left `outputs` behind."""
        key = self._key(name, inputs)
        self.keys[name] = key
        stamp = self._stamp(name)
        if not self.fresh and stamp.is_file() and all(p.exists() for p in outputs):
            done = json.loads(stamp.read_text())
            if done.get("key") == key:
                self.times[name], self.cached[name] = done["wall_s"], True
                print(f"[demo] {name}: cached (inputs {key}), {done['wall_s']:.0f} s when it ran", flush=True)
                return
        print(f"[demo] {name}: running (inputs {key})", flush=True)
        stamp.unlink(missing_ok=True)
        t0 = time.time()
        fn()
        self.times[name], self.cached[name] = time.time() - t0, False
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps({"key": key, "wall_s": self.times[name]}))
        print(f"[demo] {name}: done in {self.times[name]:.0f} s", flush=True)

    def cli(self, log_name: str, *args, echo: bool = True) -> None:
        """`python -m opd.cli ARGS`, its output kept in OUT/logs/LOG_NAME.log (and shown when `echo`)."""
        cmd = [sys.executable, "-m", "opd.cli", *map(str, args)]
        log_path = self.out / "logs" / f"{log_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"[demo] $ opd {' '.join(map(str, args))}" + ("" if echo else f"  (output: {log_path})"), flush=True)
        with log_path.open("wb") as log:
            child = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.children.add(child)
            try:
                for chunk in iter(lambda: child.stdout.read1(4096), b""):
                    log.write(chunk)
                    if echo:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.flush()
                rc = child.wait()
            except BaseException:  # Ctrl-C / SIGTERM: the command stops with the demo
                _stop(child)
                raise
            finally:
                self.children.discard(child)
        if rc != 0:
            raise StageError(f"`opd {' '.join(map(str, args))}` exited with {rc}; see {log_path}")

    # -- 0. data
    def data(self) -> None:
        params = {**FULL_DATA, **(QUICK["data"] if self.quick else {})}
        d = self.out / "data"
        outputs = [d / f"{dom}_{split}.jsonl" for dom in ("math", "code", "general") for split in ("train", "eval")]
        self.stage("0_data", [json.dumps(params), Path(REPO / "opd" / "tiny" / "data.py")], outputs,
                   lambda: write_demo_data(d, **params))

    # -- 1. start point: the base; the student starts as a copy of it
    def start(self) -> None:
        cfg = self.config(TEMPLATES / "sft_base.yaml", "sft_base")
        model = self.out / "sft_base" / "model"
        self.stage("1_sft_base", [cfg, self.keys["0_data"]], [model / "config.json"],
                   lambda: self.cli("sft_base", "sft", cfg, "--overwrite"))
        # The merge config trains OUT/student; the base itself stays as it is, for comparison.
        student = self.out / "student"
        if not (student / "config.json").is_file() or self.cached.get("1_sft_base") is False:
            shutil.rmtree(student, ignore_errors=True)
            shutil.copytree(model, student)

    # -- 2. experts: a short domain SFT warm-up, then GRPO (`opd rl`) against the domain verifier
    def experts(self) -> None:
        """One chain per domain; the chains run side by side (one torch thread each)."""
        from concurrent.futures import ThreadPoolExecutor

        def chain(dom: str) -> None:
            warm = self.config(TEMPLATES / f"sft_{dom}.yaml", f"sft_{dom}")
            self.stage(f"2_sft_{dom}", [warm, self.keys["1_sft_base"]],
                       [self.out / f"sft_{dom}" / "model" / "config.json"],
                       lambda: self.cli(f"sft_{dom}", "sft", warm, "--overwrite", echo=False))
            cfg = self.config(TEMPLATES / f"rl_{dom}.yaml", f"rl_{dom}")
            self.stage(f"2_rl_{dom}", [cfg, self.keys[f"2_sft_{dom}"]], [self.out / f"rl_{dom}" / "model" / "config.json"],
                       lambda: self.cli(f"rl_{dom}", "rl", cfg, "--overwrite", echo=False))

        t0 = time.time()
        pool = ThreadPoolExecutor(max_workers=len(DOMAINS))
        try:
            for f in [pool.submit(chain, d) for d in DOMAINS]:
                f.result()
        finally:  # on Ctrl-C, run() stops the children; do not wait for the chains here
            pool.shutdown(wait=False, cancel_futures=True)
        self.cached["2_experts"] = all(self.cached.get(f"2_{k}_{d}") for d in DOMAINS for k in ("sft", "rl"))
        # cached: the longer chain's recorded time stands for the side-by-side wall time
        self.times["2_experts"] = (max(self.times[f"2_sft_{d}"] + self.times[f"2_rl_{d}"] for d in DOMAINS)
                                   if self.cached["2_experts"] else time.time() - t0)

    # -- 3 + 4. serve the experts, distil the student
    def merge(self) -> None:
        # configs/merge_math_code.yaml as it is (its settings are the ones measured here); only
        # paths, ports and the --quick sizes change.
        cfg = self.config(MERGE_TEMPLATE, "merge")
        merged = yaml.safe_load(cfg.read_text())
        for t in merged["merge"]["teachers"]:
            t["address"] = f"tcp://127.0.0.1:{self.ports[t['name']]}"
        merged["run"]["out_dir"] = str(self.out / "merge")
        cfg.write_text(yaml.safe_dump(merged, sort_keys=False))
        run_dir = self.out / "merge"
        inputs = [cfg, self.keys["1_sft_base"], *(self.keys[f"2_rl_{d}"] for d in DOMAINS)]
        teachers = {d: (self.out / f"rl_{d}" / "model", self.ports[d]) for d in DOMAINS}
        self.stage("4_merge", inputs, [run_dir / "model" / "config.json"],
                   lambda: self.serve_and_train("merge", cfg, run_dir, teachers, serve_stage="3_serve"))

    def serve_and_train(self, log_name: str, cfg: Path, run_dir: Path, teachers: dict[str, tuple[Path, int]],
                        serve_stage: str | None = None) -> None:
        """Serve each teacher (name -> its model directory, port), run `opd train cfg` into a
        fresh run_dir, stop the servers; serve_stage: record their start-up time under it."""
        t0 = time.time()
        for name, (model, port) in teachers.items():
            address = f"tcp://127.0.0.1:{port}"
            print(f"[demo] serving teacher {name} on {address}", flush=True)
            self.servers.append(start_server_process(
                ["--model", model, "--bind", address, "--name", name, "--max-k", "32"],
                env={"TOKENIZERS_PARALLELISM": "false"}))
        if serve_stage:
            self.times[serve_stage] = time.time() - t0
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            self.cli(log_name, "train", cfg)
        finally:
            self.stop_servers()

    def stop_servers(self) -> None:
        while self.servers:
            self.servers.pop().stop(timeout_s=10)

    # -- 5. validation
    def validate(self) -> dict:
        overrides = {"models": [
            {"name": "base", "path": str(self.out / "sft_base" / "model"), "role": "base"},
            *({"name": f"warmup-{d}", "path": str(self.out / f"sft_{d}" / "model"), "role": "other"} for d in DOMAINS),
            *({"name": f"teacher-{d}", "path": str(self.out / f"rl_{d}" / "model"), "role": "teacher",
               "domains": [d]} for d in DOMAINS),
            {"name": "student-after", "path": str(self.out / "merge" / "model"), "role": "student"},
        ]}
        cfg = self.config(TEMPLATES / "validate.yaml", "validate", overrides)
        report = self.out / "validate" / "report.json"
        self.stage("5_validate", [cfg, self.keys["4_merge"], self.keys["1_sft_base"],
                                  *(self.keys[f"2_sft_{d}"] for d in DOMAINS)], [report],
                   lambda: self.cli("validate", "validate", cfg))
        return json.loads(report.read_text())

    # -- 6. report
    def report(self, val: dict) -> Path:
        results, metric = dict(val["results"]), "greedy"
        results["student-before"] = results["base"]  # the student starts as a copy of the base
        domains = list(next(iter(results.values())).keys())
        rows = [("base", "base (SFT start)"), *((f"warmup-{d}", f"{d} warm-up (SFT, before RL)") for d in DOMAINS),
                *((f"teacher-{d}", f"teacher {d} (RL)") for d in DOMAINS),
                ("student-before", "student before"), ("student-after", "student after")]
        lines = ["# `make demo` report", "",
                 f"Held-out accuracy ({metric} answer, checked by the domain verifier"
                 f"{'; --quick sizes: numbers are not meaningful' if self.quick else ''}).", "",
                 "| model | " + " | ".join(domains) + " |", "|---|" + "---|" * len(domains)]
        for key, label in rows:
            lines.append(f"| {label} | " + " | ".join(f"{results[key][d][metric]:.2f}" for d in domains) + " |")
        lines += ["", "Student after distillation vs its start and the matching teacher:", ""]
        for d in domains:
            after, before = results["student-after"][d][metric], results["student-before"][d][metric]
            teacher = results.get(f"teacher-{d}", {}).get(d, {}).get(metric)
            share = ("no teacher for this domain" if teacher is None else "the teacher scores 0" if teacher == 0
                     else f"{after / teacher:.0%} of the teacher's {teacher:.2f}")
            lines.append(f"- **{d}**: {before:.2f} -> {after:.2f} ({share})")
        # The RL stage against its own start: the teacher is its warm-up after `opd rl`.
        rl_gain = {d: (results[f"warmup-{d}"][d][metric], results[f"teacher-{d}"][d][metric]) for d in DOMAINS
                   if d in domains and f"warmup-{d}" in results and f"teacher-{d}" in results}
        lines += ["", "RL stage: " + ", ".join(f"{d} {w:.2f} -> {t:.2f} ({t - w:+.2f})" for d, (w, t) in rl_gain.items())
                  + " over its SFT warm-up (held-out, the same prompts)"]
        lines += ["", f"Outcome checks (each expert must beat the base by 0.1, the RL stage its SFT warm-up by "
                  f"{RL_GAIN_MIN} on at least one domain, the student its start, and the student must reach 80 % "
                  "of the matching teacher):", ""]
        if self.quick:
            lines.append("- RL stage: not checked with --quick (a few GRPO steps on tiny sizes: its numbers "
                         "say nothing)")
        else:
            best = max(rl_gain, key=lambda d: rl_gain[d][1] - rl_gain[d][0])
            ok = rl_gain[best][1] - rl_gain[best][0] >= RL_GAIN_MIN - 1e-9
            lines.append(f"- RL stage: {'PASS' if ok else 'FAIL'} raises held-out accuracy over its SFT warm-up "
                         f"by >= {RL_GAIN_MIN} on at least one domain (" +
                         ", ".join(f"{d} {t - w:+.2f}" for d, (w, t) in rl_gain.items()) + ")")
        for d in domains:
            base, after = results["base"][d][metric], results["student-after"][d][metric]
            teacher = results.get(f"teacher-{d}", {}).get(d, {}).get(metric)
            if teacher is None:
                continue
            checks = [(f"teacher beats the base by {teacher - base:+.2f}", teacher - base >= 0.1),
                      (f"student beats its start ({after:.2f} > {base:.2f})", after > base),
                      (f"student reaches {after / teacher if teacher else 0:.0%} of the teacher (>= 80%)",
                       teacher > 0 and after >= 0.8 * teacher)]
            lines.append(f"- {d}: " + "; ".join(f"{'PASS' if ok else 'FAIL'} {text}" for text, ok in checks))
        lines += ["", "Every model here was trained by this run from a seed: no checkpoint ships with the "
                  "repository and nothing is downloaded.", "", "## Wall time per stage", "", "| stage | seconds | |", "|---|---|---|"]
        for stage, secs in self.times.items():
            note = ("cached" if self.cached.get(stage) else "part of 4_merge" if stage == "3_serve" else
                    "the two domain chains side by side" if stage == "2_experts" else
                    "in parallel with the other domain" if stage.startswith("2_") else "")
            lines.append(f"| {stage} | {secs:.0f} | {note} |")
        total = sum(s for k, s in self.times.items()
                    if not self.cached.get(k) and (k in ("2_experts",) or not k.startswith(("2_", "3_"))))
        lines.append(f"| total (this run) | {total:.0f} | |")
        lines += ["", "## Plots and training cards", ""]
        runs = ("sft_base", *(f"sft_{d}" for d in DOMAINS), *(f"rl_{d}" for d in DOMAINS), "merge", "validate")
        lines += self.run_links(self.out, runs)
        return self.write_report(self.out / "report.md", lines)

    @staticmethod
    def run_links(root: Path, runs) -> list[str]:
        """One report line per run directory under root: links to its card, report and plots."""
        lines = []
        for run in runs:
            d = root / run
            links = [f"[{p.relative_to(root)}]({p.relative_to(root)})"
                     for p in [d / "card.md", d / "report.md", *sorted((d / "plots").glob("*.png"))] if p.exists()]
            if links:
                lines.append(f"- {run}: " + ", ".join(links))
        return lines

    @staticmethod
    def write_report(path: Path, lines: list[str]) -> Path:
        """Write the report's lines to path and print them."""
        text = "\n".join(lines) + "\n"
        path.write_text(text)
        print("\n" + text, flush=True)
        return path

    def run(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.data()
            self.start()
            self.experts()
            self.merge()
            return self.report(self.validate())
        finally:
            self.stop_all()

    def stop_all(self) -> None:
        """Stop the stage processes still running and the teacher servers (Ctrl-C, a failure)."""
        for child in list(self.children):
            _stop(child)
        self.stop_servers()


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()


def parse_ports(text: str) -> dict[str, int]:
    ports = [int(p) for p in text.split(",")]
    names = list(DEFAULT_PORTS)
    if not 1 <= len(ports) <= len(names):
        raise argparse.ArgumentTypeError(f"give 1 to {len(names)} ports, for {', '.join(names)}")
    return {**DEFAULT_PORTS, **dict(zip(names, ports))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="demo folder (stages, models, report.md)")
    p.add_argument("--fresh", action="store_true", help="redo every stage, ignoring cached results")
    p.add_argument("--quick", action="store_true", help="tiny sizes for the test: checks the plumbing, not the outcome")
    p.add_argument("--ports", type=parse_ports, default=dict(DEFAULT_PORTS),
                   help="teacher ports, comma-separated, in the order math,code,general")
    p.add_argument("--seed", type=int, default=None,
                   help="training seed of every stage (models' initialization, sampling, data order); the "
                        "data sets and held-out prompts stay the same. Default: the configs' own (0). Give each "
                        "seed its own --out to keep every run's results")
    p.add_argument("--agentic", action="store_true",
                   help="run the agentic stage instead of the recipe (scripts/demo_agentic.py: a tool-using teacher, "
                        "its student distilled with the calculator; OUT/agentic/report.md); the teacher is served "
                        "on the first of --ports")
    args = p.parse_args(argv)

    def on_term(signum, frame):  # SIGTERM behaves like Ctrl-C: unwind, stop servers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    demo = Demo(args.out.resolve(), quick=args.quick, fresh=args.fresh, ports=args.ports, seed=args.seed)
    t0 = time.time()
    try:
        if args.agentic:
            from demo_agentic import run_agentic   # beside this file (sys.path[0] when run as a script)

            report = run_agentic(demo)
        else:
            report = demo.run()
    except KeyboardInterrupt:
        print("\n[demo] interrupted; teacher servers stopped", file=sys.stderr)
        return 130
    except StageError as e:
        print(f"[demo] failed: {e}", file=sys.stderr)
        return 1
    print(f"[demo] report: {report} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
