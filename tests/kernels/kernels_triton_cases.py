"""Triton cases, run under the interpreter in their own process (see test_kernels_triton.py).

TRITON_INTERPRET must be set before triton is imported, and must not leak into other
test folders, so this file is a script: `python kernels_triton_cases.py` prints one JSON
result per case (kernels_cases.check, then each of kernels_cases.EDGE_CHECKS) on stdout.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_cases import EDGE_CHECKS, TRITON_CASES, check  # noqa: E402


if __name__ == "__main__":
    warnings.simplefilter("ignore")   # numpy warns about inf - inf in masked-out lanes
    for case in TRITON_CASES:
        print(json.dumps(check(case)), flush=True)
    for edge in EDGE_CHECKS:
        print(json.dumps(edge("triton")), flush=True)
