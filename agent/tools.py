"""The tools a model may call: declared functions, their JSON schemas, and calls that never raise.

    tool = resolve(ToolSpec("calculator"), base_dir)     # or "module:function", "FILE.py:function"
    box = build_toolbox(agent_cfg, base_dir)
    box.schemas()                                        # the chat template's `tools=`
    box.call("calculator", '{"expression": "2 ** 64"}')  # ToolOutcome(ok=True, text="18446744073709551616")

A schema comes from the function's signature and Google-style docstring
(transformers.utils.get_json_schema). Resolving imports the function here only to build that
schema; every call runs in the sandbox's limited child (agent/sandbox.py), its own process.
A model's call can be wrong in every way (an unknown name, arguments that are not an object,
a tool that raises, hangs or floods its output): each comes back as ToolOutcome(ok=False,
text="error: ...") that the model reads, never as an exception in the rollout loop.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from opd.agent import builtin_tools
from opd.agent.config import AgentConfig, ToolSpec
from opd.agent.sandbox import SandboxLimits, call_function

BUILTINS = ("calculator", "python")


@dataclass(frozen=True)
class Tool:
    name: str       # what the model calls it by
    ref: str        # what the sandbox's child imports: 'module:function' or '/abs/FILE.py:function'
    schema: dict    # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    text: str       # what the model reads: the tool's answer, or "error: ..."


def resolve(spec: ToolSpec, base_dir: str | Path = ".") -> Tool:
    """The tool `spec` declares; ValueError naming the spec and why when it cannot be called."""
    ref = spec.function
    if ref in BUILTINS:
        # by path: the child runs with -S, where an editable install's import hooks do not load
        ref = f"{Path(builtin_tools.__file__).resolve()}:{ref}"
    where, _, attr = ref.rpartition(":")
    if not where or not attr:
        raise ValueError(f"{spec}: expected 'module:function', 'FILE.py:function' or a built-in "
                         f"({', '.join(BUILTINS)})")
    path = (Path(base_dir) / where).resolve() if where.endswith(".py") else None   # absolute stays absolute
    if path is not None and not path.is_file():
        raise ValueError(f"{spec}: no file {path}")
    try:
        module = _load_file(path) if path is not None else importlib.import_module(where)
    except Exception as e:   # an import can fail in any way its module's code does
        raise ValueError(f"{spec}: cannot import {where}: {type(e).__name__}: {e}") from e
    if path is not None:
        ref = f"{path}:{attr}"
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"{spec}: {where} has no function {attr}")
    # imported here: transformers is slow to import, and only resolving needs it
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as e:   # a missing type hint or Args: entry: the model could not know how to call it
        raise ValueError(f"{spec}: cannot describe {attr} as a tool ({e}); it needs type hints and a "
                         "Google-style docstring with an Args: section") from e
    name = spec.name or attr
    schema["function"]["name"] = name
    return Tool(name, ref, schema)


def _load_file(path: Path):
    # A name of its own per file (two tool files may share a stem); registered in sys.modules
    # because dataclasses and pickling look a class's module up there.
    name = "_opd_tool_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


class Toolbox:
    """Calls of the tools by name, each in its own sandbox process, under the agent's limits."""

    def __init__(self, tools: list[Tool], cfg: AgentConfig):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"agent.tools: two tools share a name among {[t.name for t in tools]}")
        self.cfg = cfg
        self.limits = SandboxLimits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb)

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def call(self, name: str, arguments) -> ToolOutcome:
        """Run one call; `arguments` is a dict or its JSON text. Never raises."""
        try:
            return self._call(name, arguments)
        except Exception as e:   # the promise to the rollout loop: a bad call is an answer, not a crash
            return self._error(f"the call failed: {type(e).__name__}: {e}")

    def call_many(self, calls: list[tuple[str, object]]) -> list[ToolOutcome]:
        """Each (name, arguments) at once on up to cfg.workers threads, outcomes in order."""
        if not calls:
            return []
        with ThreadPoolExecutor(max_workers=min(self.cfg.workers, len(calls))) as pool:
            return list(pool.map(lambda c: self.call(c[0], c[1]), calls))

    def _call(self, name, arguments) -> ToolOutcome:
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return self._error(f"unknown tool {name!r}; the tools are: {', '.join(self.names) or 'none'}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return self._error(f"the arguments of {name} are not valid JSON ({e.msg})")
        if arguments is None:   # a call that gave no arguments at all
            arguments = {}
        if not isinstance(arguments, dict):
            kind = _JSON_TYPES.get(type(arguments), type(arguments).__name__)
            return self._error(f"the arguments of {name} must be a JSON object, not {kind}")
        problem = _check_arguments(tool, arguments)
        if problem:
            return self._error(problem)
        result = call_function(tool.ref, arguments, self.limits)
        if result.status == "ok":
            return ToolOutcome(True, self._cut(result.text, result.omitted))
        return self._error(result.text, result.omitted)

    def _error(self, text: str, omitted: int = 0) -> ToolOutcome:
        return ToolOutcome(False, self._cut("error: " + text, omitted))

    def _cut(self, text: str, omitted: int = 0) -> str:
        """At most cfg.max_output_chars of `text`, saying how much more there was (the sandbox
        already left `omitted` characters out)."""
        limit = self.cfg.max_output_chars
        more = max(0, len(text) - limit) + omitted
        return text[:limit] + f"...[cut: {more} more characters]" if more else text


def _check_arguments(tool: Tool, arguments: dict) -> str:
    """What is wrong with `arguments` by the schema (before any process starts), or ""."""
    params = tool.schema["function"].get("parameters", {})
    known = params.get("properties", {})
    expected = ", ".join(known) or "no arguments"
    unknown = [a for a in arguments if a not in known]
    if unknown:
        return f"{tool.name} has no argument {', '.join(map(repr, unknown))} (it takes: {expected})"
    missing = [a for a in params.get("required", []) if a not in arguments]
    if missing:
        return f"{tool.name} is missing the argument {', '.join(map(repr, missing))} (it takes: {expected})"
    return ""


def build_toolbox(cfg: AgentConfig, base_dir: str | Path = ".") -> Toolbox:
    """The Toolbox of `cfg.tools`, FILE.py paths relative to `base_dir` (the config's folder)."""
    return Toolbox([resolve(spec, base_dir) for spec in cfg.tools], cfg)
