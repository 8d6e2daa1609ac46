"""`opd CMD ...` with a fault injected into the real checkpoint code, for tests/faults.

    python fault_train_wrapper.py kill-in-checkpoint STEP -- train CONFIG ...
        SIGKILL this process while checkpoint STEP is being written: every file is in its
        temporary directory, nothing is renamed yet (the worst moment for a torn checkpoint)
    python fault_train_wrapper.py disk-full-after-checkpoint BYTES -- train CONFIG ...
        after the first checkpoint is complete, no file may grow past BYTES (RLIMIT_FSIZE;
        SIGXFSZ ignored, so writes fail with EFBIG as they would with ENOSPC on a full disk)
"""

from __future__ import annotations

import os
import resource
import signal
import sys


def main() -> int:
    mode, value, sep, *argv = sys.argv[1:]
    assert sep == "--", sys.argv
    import opd.checkpoint as ckpt

    if mode == "kill-in-checkpoint":
        fsync_tree = ckpt._fsync_tree

        def dying_fsync(path):
            fsync_tree(path)
            if path.name.startswith(f"step_{int(value):06d}.tmp-"):
                os.kill(os.getpid(), signal.SIGKILL)

        ckpt._fsync_tree = dying_fsync
    elif mode == "disk-full-after-checkpoint":
        import opd.spine.run

        save = ckpt.save_checkpoint

        def save_then_fill(*args, **kwargs):
            out = save(*args, **kwargs)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            return out

        opd.spine.run.save_checkpoint = save_then_fill
    else:
        raise SystemExit(f"unknown mode {mode}")
    from opd.cli import main as opd_main

    return opd_main(argv)


if __name__ == "__main__":
    sys.exit(main())
