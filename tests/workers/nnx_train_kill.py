"""Run examples/nnx_train.py, optionally SIGKILLing this process at a point of a save.

usage: nnx_train_kill.py DIR STEPS EVERY [KILL_POINT SAVE_NUMBER]
   KILL_POINT and SAVE_NUMBER as in train_kill.py ('stage', 'write' or 'commit'; the saves of
   this run counted from 1).
Reports each training step's loss as it is computed ('RESULT {"loss": ...}', the float's
exact value) and, when the run ends, the example's exit code; the example's own lines
('resumed at step ...', 'step N loss ... params DIGEST') are on stdout beside them.
"""

from __future__ import annotations

import sys

from _dist import report
from train_kill import install_kill, load_example


def main() -> None:
    directory, steps, every = sys.argv[1], sys.argv[2], sys.argv[3]
    if len(sys.argv) > 4:
        install_kill(sys.argv[4], int(sys.argv[5]))
    example = load_example("nnx_train")
    step = example.train_step

    def logged_step(*args):
        loss = step(*args)
        report(loss=float(loss))
        return loss

    example.train_step = logged_step
    report(code=example.main(["--dir", directory, "--steps", steps, "--save-every", every]))


if __name__ == "__main__":
    main()
