"""opd: distillation-first teacher-student post-training.

Import root for the whole project. The top-level folders of the repository are its
subpackages (`opd.kernels` lives in `kernels/`, `opd.teachers` in `teachers/`,
`opd.routing` in `routing/`, `opd.rl` in `rl/`, `opd.benchmarks` in `benchmarks/`);
pyproject.toml maps them for an installed or editable package. Inside `opd/`: the ground
floor (config, data, checkpoint, metrics, card, fingerprint, rope, lm_head, diagnostics,
lora, tiny), the training spine (`spine/`), rollout engines (`rollout/`), the loops of
`opd train` (`distill/`) and `opd sft` (`sft/`), Ray placement (`cluster/`), and the
command line (`cli.py`). docs/architecture.md draws the floors.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

# Running from a source tree without installing (e.g. on a GPU box that has torch and
# triton but not our venv): let `opd.kernels` resolve to `<repo>/kernels` by searching
# the repository root for subpackages too. An installed package never needs this.
_root = _Path(__file__).resolve().parent.parent
if (_root / "kernels" / "__init__.py").is_file() and str(_root) not in __path__:
    __path__.append(str(_root))
