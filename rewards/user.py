"""User reward functions loaded from a Python file named in the config.

`path: my_rewards.py:brevity` loads my_rewards.py as a module (relative paths against the
config file's folder) and uses its function `brevity(sample, response_text) -> float`.
The file runs in the trainer's own process: it is trusted code, unlike model outputs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable


def load_user_reward(spec: str, base_dir: str | Path | None = None) -> Callable:
    if ":" not in spec:
        raise ValueError(f"user reward {spec!r} must be 'FILE.py:function'")
    file, func = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise FileNotFoundError(f"user reward file {path} not found (from {spec!r})")
    mod_spec = importlib.util.spec_from_file_location(f"opd_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {func!r}")
    return fn
