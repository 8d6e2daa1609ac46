"""The chunked path's memory beyond its inputs, measured as peak RSS in a fresh process."""

from __future__ import annotations

import subprocess
import sys

# Forward of a full-vocabulary forward KL at N=512, V=32768 (64 MiB per [N, V] fp32 tensor,
# 64 tiles of 1 MiB). `import argparse` first puts the heap in a state where per-tile live
# tensors used to fragment it: the forward then took ~2.5 MiB of fresh memory per tile.
SCRIPT = """
import argparse, torch
from opd.kernels import distill_loss
def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) // 1024
x = torch.empty(512, 32768).normal_().mul_(2).requires_grad_(True)
t = torch.empty(512, 32768).normal_().mul_(2)
base = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS
loss = distill_loss(x, t, beta=0.0, impl="torch")
forward = rss("VmHWM") - base
loss.backward()
print(forward, rss("VmHWM") - base)
"""


def test_full_vocab_forward_kl_needs_tiles_not_copies():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    forward_mib, backward_mib = map(int, out.stdout.split())
    assert forward_mib < 24, forward_mib                 # a few 1 MiB tiles and [N, chunks] stats
    assert 64 <= backward_mib < 64 + 24, backward_mib    # the gradient [N, V] and a few tiles
