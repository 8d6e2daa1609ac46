"""The floor plan holds: which package may import which, no import circle, modules small enough
to read, and the project's own imports at the top of each file. docs/architecture.md draws it.

The imports are read from the source with `ast` (nothing is imported); `python -m pytest
tests/test_floors.py -q -s` prints each floor's imports of the others.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The import root and where its subpackages live (pyproject.toml's package-dir).
ROOTS = {"opd": "opd", "opd.kernels": "kernels", "opd.teachers": "teachers", "opd.routing": "routing",
         "opd.agent": "agent", "opd.rl": "rl", "opd.rewards": "rewards", "opd.benchmarks": "benchmarks"}
GROUND = ("opd.config", "opd.errors", "opd.data", "opd.checkpoint", "opd.metrics", "opd.card", "opd.fingerprint", "opd.rope",
          "opd.lm_head", "opd.diagnostics", "opd.lora", "opd.tiny", "opd.vllm_args")
# floor -> what it may import besides itself, the ground floor and third-party packages. A
# floor imports only floors below it: a new capability lands where this list allows it.
MAY_IMPORT = {
    "ground": (),
    "opd.kernels": None,   # None: nothing of the project at all (it runs with torch and triton alone)
    "opd.teachers": ("opd.kernels",),   # the client side's top-k answers are the kernels' TopKTeacher
    "opd.rollout": (),
    # tools, their sandbox, and the multi-turn loop over a rollout engine (code rewards share the sandbox)
    "opd.agent": ("opd.rollout",),
    "opd.rewards": ("opd.agent",),   # code rewards run in the agent's sandbox
    "opd.routing": ("opd.teachers",),
    "opd.spine": ("opd.rollout", "opd.kernels"),   # the sampled tokens' log-probs (spine.rows.token_logprobs)
    "opd.cluster": ("opd.teachers", "opd.rollout", "opd.spine"),
    "opd.sft": ("opd.spine", "opd.agent"),
    "opd.generate": ("opd.spine", "opd.rollout", "opd.rewards", "opd.teachers"),   # a teacher's samples as SFT data   # tools: the schemas an agentic rollout renders its prompts with
    # the teacher logit store: a teacher's answers scored once (its client), on sequences sampled by the student
    "opd.store": ("opd.teachers", "opd.rollout", "opd.spine", "opd.routing.config"),
    # opd rl and opd train share the client side of the teacher servers (opd.teachers.session)
    # and the verifiers (opd.rewards); neither imports the other
    "opd.rl": ("opd.rollout", "opd.agent", "opd.spine", "opd.cluster", "opd.kernels", "opd.routing.config", "opd.teachers",
               "opd.rewards"),
    "opd.distill": ("opd.kernels", "opd.teachers", "opd.rollout", "opd.agent", "opd.routing", "opd.spine", "opd.cluster",
                    "opd.rewards", "opd.store"),
    "opd.benchmarks": ("*",),
    "opd.cli": ("*",),
}
# Imports of the project's own modules inside a function, and why each must stay there.
LAZY = {
    ("opd.kernels.loss", "opd.kernels.triton_ops"): "triton is optional and heavy",
    ("opd.teachers.launch", "opd.teachers.serve"): "the server and torch, in a forked child only",
    ("opd.benchmarks.kernels", "opd.kernels.triton_ops"): "triton, for the Triton rows only",
    **{("opd.benchmarks.recipes_worker", m): "a worker subprocess imports the library snapshot the run copied"
       for m in ("opd.rollout", "opd.rollout.hf", "opd.spine.config", "opd.spine.model", "opd.data", "opd.rewards")},
    ("opd.benchmarks.recipes", "opd.teachers.launch"): "the teacher servers, started only by the arms that use them",
    **{(bench, m): "`opd bench --help` imports every subject for its arguments: torch, the trainer and the "
                   "servers load only when this subject runs"
       for bench, ms in (("opd.benchmarks.sampled_noise", ("opd.config", "opd.data", "opd.distill.config",
                                                           "opd.distill.trainer", "opd.distill.stats",
                                                           "opd.teachers.launch")),
                         ("opd.benchmarks.long_horizon", ("opd.data", "opd.rewards", "opd.teachers.launch")))
       for m in ms},
    **{(cli, m): "`--help` and a refused config answer without torch (7 s of imports)"
       for cli, trainer in (("opd.rl.train", "opd.rl.trainer"), ("opd.distill.cli", "opd.distill.trainer"),
                            ("opd.sft.cli", "opd.sft.trainer"))
       for m in (trainer, "opd.spine.dist")},
    **{("opd.generate.cli", "opd.generate.sample"): "`--help` and a refused config answer without torch"},
    ("opd.store.cli", "opd.store.write"): "`--help` and a refused config answer without torch",
    **{("opd.rl.validate", m): "`opd validate --help` and a refused config answer without torch (5 s of imports)"
       for m in ("opd.rl.trainer", "opd.rollout.hf", "opd.rollout.vllm", "opd.spine.model", "opd.rl.checks")},
}
MAX_LINES = 500


def _files() -> dict[str, Path]:
    """module name -> file, for every source file of the import root."""
    out = {}
    for pkg, folder in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [] if rel.parts == ("__init__",) else [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "opd" and parts and f"opd.{parts[0]}" in ROOTS:
                continue
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported project module, inside a function) for every import of the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names if a.name.split(".")[0] == "opd")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "opd":
                    continue
                for a in child.names:   # `from opd.x import y` names module opd.x.y when there is one
                    found.append((f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, in_function))
            visit(child, nested)

    visit(tree, False)
    return [(m, lazy) for m, lazy in found if m in modules]


def _floor(module: str) -> str:
    if module.startswith(GROUND):
        return "ground"
    return next((f for f in sorted(MAY_IMPORT, key=len, reverse=True) if module == f or module.startswith(f + ".")),
                "ground" if module == "opd" else module)


def _graph():
    files = _files()
    modules = set(files)
    edges = {m: _imports(m, p, modules) for m, p in files.items()}
    return files, edges


def test_each_floor_imports_only_the_floors_below_it():
    _, edges = _graph()
    wrong, seen = [], defaultdict(set)
    for src, targets in edges.items():
        for dst, _ in targets:
            a, b = _floor(src), _floor(dst)
            if a == b or b == "ground" and MAY_IMPORT.get(a) is not None:
                continue
            seen[a].add(b)
            allowed = MAY_IMPORT.get(a, ())
            if allowed is None or not ("*" in allowed or b in allowed or dst.startswith(tuple(allowed))):
                wrong.append(f"{src} -> {dst}")
    for a in sorted(seen):
        print(f"{a:15} imports {', '.join(sorted(seen[a]))}")
    assert not wrong, wrong


def test_no_import_circle_among_the_project_files():
    # Tarjan's strongly connected components over every import, lazy ones included; importing a
    # module of another package runs that package's __init__ first, so that edge is drawn too.
    _, edges = _graph()
    graph = defaultdict(set)
    for src, targets in edges.items():
        for dst, _ in targets:
            graph[src].add(dst)
            parent = dst.rsplit(".", 1)[0]
            if parent in edges and not src.startswith(parent + ".") and src != parent:
                graph[src].add(parent)
    index, low, stack, on, circles = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                circles.append(sorted(group))

    for v in list(edges):
        if v not in index:
            strong(v)
    assert not circles, circles


def test_modules_stay_small_enough_to_read():
    files, _ = _graph()
    long = {m: n for m, p in files.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_projects_own_imports_are_at_the_top_of_each_file():
    _, edges = _graph()
    lazy = {(src, dst) for src, targets in edges.items() for dst, in_function in targets if in_function}
    assert lazy == set(LAZY), sorted(lazy ^ set(LAZY))
