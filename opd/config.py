"""Typed configs loaded from YAML.

Every config is a frozen dataclass. `load_yaml(path, cls)` builds it from a YAML file
and refuses unknown keys, wrong types and missing required fields with one message that
names the file, the line and the key, and says what was expected. Nothing starts on a
bad config.

Field documentation lives in the dataclass: a field's `metadata={"help": ...}` is used
by `--help` and by `describe(cls)`.

A key that moved or went is refused with where it went: a class's `RETIRED` maps such keys to
that note, and its `RETIRED_SCALAR` is the note for a plain value where the class is now a
section (opd sft's `model: DIR` is `model: {path: DIR}`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, line, key and expectation."""


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
          choices: tuple | None = None, min: float | None = None, max: float | None = None,
          aliases: tuple[str, ...] = ()):
    """A dataclass field with a one-line `help` and optional range checks. `aliases`: earlier
    names of the key that a YAML file may still use (`opd rl`'s `ckpt_every` is `run.checkpoint_every`
    since the loops share their run section); they are read as the field, never written."""
    md = {"help": help, "choices": choices, "min": min, "max": max, "aliases": tuple(aliases)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _where(source: str, node: yaml.Node | None) -> str:
    if node is None:
        return source
    return f"{source}:{node.start_mark.line + 1}"


def _plain(node: yaml.Node) -> Any:
    return yaml.safe_load(yaml.serialize(node)) if node is not None else None


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _convert(tp: Any, node: yaml.Node, source: str, key: str) -> Any:
    """Convert a YAML node into a value of type `tp`, or raise ConfigError."""
    origin = get_origin(tp)
    where = _where(source, node)
    if dataclasses.is_dataclass(tp):
        if not isinstance(node, yaml.MappingNode):
            moved = getattr(tp, "RETIRED_SCALAR", None)   # the key held a plain value before it held this section
            raise ConfigError(f"{where}: key '{key}' expects a mapping ({tp.__name__}), got {_plain(node)!r}"
                              + (f": {moved}" if moved else ""))
        return _build(tp, node, source, prefix=key)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null") and type(None) in args:
            return None
        if len([a for a in args if a is not type(None)]) == 1:   # `X | None`: X's own message (file:line, key)
            return _convert(next(a for a in args if a is not type(None)), node, source, key)
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, node, source, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: key '{key}' expects {' or '.join(_type_name(a) for a in args)}, "
                          f"got {_plain(node)!r}")
    if origin is Literal:
        value = _plain(node)
        if value not in get_args(tp):
            raise ConfigError(f"{where}: key '{key}' expects one of {list(get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(node, yaml.SequenceNode):
            raise ConfigError(f"{where}: key '{key}' expects a list, got {_plain(node)!r}")
        (item_tp, *rest) = get_args(tp) or (Any,)
        items = [_convert(item_tp, n, source, f"{key}[{i}]") for i, n in enumerate(node.value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{where}: key '{key}' expects a mapping, got {_plain(node)!r}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(_plain(k)): _convert(val_tp, v, source, f"{key}.{_plain(k)}") for k, v in node.value}
    value = _plain(node)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and node.style is None and _FLOAT.fullmatch(value):
        return float(value)   # `1e-4`: YAML 1.1 reads a float without a dot as a string
    if tp is Path and isinstance(value, str):
        return Path(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{where}: key '{key}' expects {tp.__name__}, got {value!r}")
    return value


def _check_range(f: dataclasses.Field, value: Any, where: str, key: str) -> None:
    md = f.metadata
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):   # .nan passes every < and > check
        raise ConfigError(f"{where}: key '{key}' must be a finite number, got {value!r}")
    if md.get("choices") and value not in md["choices"]:
        raise ConfigError(f"{where}: key '{key}' expects one of {list(md['choices'])}, got {value!r}")
    if md.get("min") is not None and value < md["min"]:
        raise ConfigError(f"{where}: key '{key}' must be >= {md['min']}, got {value!r}")
    if md.get("max") is not None and value > md["max"]:
        raise ConfigError(f"{where}: key '{key}' must be <= {md['max']}, got {value!r}")


def _build(cls: type[T], node: yaml.MappingNode, source: str, prefix: str = "") -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    aliases = {a: name for name, f in fields.items() for a in f.metadata.get("aliases", ())}
    kwargs = {}
    for knode, vnode in node.value:
        key = aliases.get(_plain(knode), _plain(knode))
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            retired = getattr(cls, "RETIRED", {}).get(key)   # a key that moved or went: say where or why
            if retired:
                raise ConfigError(f"{_where(source, knode)}: key '{full}' is no longer read here: {retired}")
            raise ConfigError(f"{_where(source, knode)}: unknown key '{full}' for {cls.__name__}; "
                              f"expected one of: {', '.join(sorted(fields))}")
        if key in kwargs:   # YAML keeps the last one silently
            raise ConfigError(f"{_where(source, knode)}: key '{full}' given twice"
                              + (f" (as {_plain(knode)!r}, an earlier name of it)" if _plain(knode) != key else ""))
        value = _convert(hints[key], vnode, source, full)
        _check_range(fields[key], value, _where(source, vnode), full)
        kwargs[key] = value
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{_where(source, node)}: missing required key(s) "
                          f"{', '.join(f'{prefix}.{m}' if prefix else m for m in missing)} for {cls.__name__}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ checks across fields
        raise ConfigError(f"{_where(source, node)}: {prefix or cls.__name__}: {e}") from None


def from_yaml_text(text: str, cls: type[T], source: str = "<string>", section: str | None = None) -> T:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    if node is None:
        node = yaml.MappingNode("tag:yaml.org,2002:map", [])
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{source}: the top level must be a mapping of keys to values")
    if section is None:
        return _build(cls, node, source)
    found = [v for k, v in node.value if _plain(k) == section]
    if not found:
        raise ConfigError(f"{source}: no `{section}:` section")
    return _convert(cls, found[-1], source, section)


def load_yaml(path: str | Path, cls: type[T], *, section: str | None = None) -> T:
    """Load `path` into the frozen dataclass `cls`; raise ConfigError with file:line on any problem.
    section: build `cls` from that top-level key only (the `merge:` of a train config), its keys
    named `section.key` in errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    return from_yaml_text(p.read_text(), cls, source=str(p), section=section)


def from_dict(data: dict, cls: type[T], source: str = "<dict>") -> T:
    """Build a config from a plain dict (same checks as YAML)."""
    return from_yaml_text(yaml.safe_dump(data), cls, source=source)


def to_dict(cfg: Any) -> dict:
    """A plain, YAML/JSON-serializable dict of a config (Paths become strings)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v
    return plain(cfg)


def describe(cls: type, indent: str = "") -> str:
    """Every field of a config class with its type, default and help, nested; for --help and docs."""
    lines = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = ("required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   else f"default {f.default!r}" if f.default is not dataclasses.MISSING
                   else f"default {f.default_factory()!r}")
        inner = [a for a in (get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp) or inner:
            lines.append(f"{indent}{f.name}:  {f.metadata.get('help', '')}")
            lines.append(describe(inner[0] if inner else tp, indent + "  "))
        else:
            was = f.metadata.get("aliases") or ()
            lines.append(f"{indent}{f.name} ({_type_name(tp)}, {default}): {f.metadata.get('help', '')}"
                         + (f" (formerly {', '.join(was)})" if was else ""))
    return "\n".join(lines)


def check_device(device: str, *, auto: bool = False) -> None:
    """A torch device string, checked with the config (a typo failed only when the model moved)."""
    if not ((auto and device == "auto") or re.fullmatch(r"(cpu|cuda|xpu|mps|npu)(:\d+)?", device)):
        raise ValueError(f"device {device!r}: expected {'auto, ' if auto else ''}cpu, cuda or cuda:N")


def check_top_p(top_p: float, key: str) -> None:
    """Nucleus sampling keeps the smallest set of tokens whose mass reaches top_p: 0 keeps none
    (the hf engine fell back to greedy, vLLM refused it at the first rollout)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{key} {top_p}: expected a value in (0, 1] (1: no nucleus cut; for greedy "
                         f"decoding set the temperature to 0)")


# Modules vLLM 0.32 cannot load a LoRA adapter on (it supports the blocks' linear projections):
# the engine died at its first rollout, after the run had started.
VLLM_NO_LORA = ("lm_head", "embed_tokens")


def check_vllm_lora(target_modules: list[str], key: str) -> None:
    bad = sorted(m for m in target_modules if m in VLLM_NO_LORA)
    if bad:
        raise ValueError(f"{key}: rollout.engine vllm cannot load a LoRA adapter on {bad} (vLLM adapts the "
                         f"blocks' linear projections only); use rollout.engine hf, or other target_modules")


def number_arg(kind: type = int, low: float = 1, *, strict: bool = False, note: str = ""):
    """argparse type of a number given on the command line (--steps, --max-k, --timeout-s, ...):
    a value given there skips the config's range checks, so 0 or -3 would be taken as is.
    `kind` int or float (finite); at least `low`, or above it when `strict`; `note` follows
    the bound in the error ("(0: no limit)")."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low)):
            bound = f"above {low:g}" if strict else f"{'of ' if kind is float else ''}at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if kind is float else ''}{bound}{note}, "
                                             f"got {text}")
        return value
    return parse


positive_int = number_arg(int, 1)


def near(base: str | Path, p: str | None) -> str | None:
    """A path as written in a config file: `~` expanded, relative paths taken relative to the
    file's folder `base`, absolute ones kept (so resolving twice changes nothing)."""
    if p is None:
        return None
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else Path(base) / q)


def config_arguments(parser, cls: type, what: str, example: str, about: str = "") -> None:
    """A config command's `CONFIG` and `--describe`, and its --help epilog: `about`, then every
    key of `cls` (what `config_from_args` reads back)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", nargs="?", help=f"{what} config YAML (e.g. {example})")
    parser.add_argument("--describe", action="store_true", help="print every config key with its help and exit")
    parser.epilog = (about + ("\n\n" if about else "") + "Config keys (YAML; unknown keys are refused with "
                     "file:line; relative paths are relative to the config file):\n\n" + describe(cls, "  "))


def config_from_args(args, cls: type[T], command: str, example: str):
    """A command's config from `args.config` (`--describe`: every key printed): the loaded
    config, or the exit code when there is none to run with (0 after --describe; 2 with the
    reason on stderr: no file given, or a ConfigError naming file:line)."""
    if getattr(args, "describe", False):
        print(describe(cls))
        return 0
    if not args.config:
        print(f"opd {command}: error: a config file is needed: opd {command} CONFIG.yaml (e.g. {example}; "
              f"--describe lists its keys)", file=sys.stderr)
        return 2
    try:
        return load_yaml(Path(args.config).resolve(), cls)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
