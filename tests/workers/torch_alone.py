"""snapshard.torch in one process where JAX cannot be imported (SNAPSHARD_TEST_WITHOUT_JAX):
save, async save, load, metadata, the manager, a NumPy restore and the CLI.

    torch_alone.py DIR    reports what came back and whether JAX was imported
"""

from __future__ import annotations

import collections
import os
import sys

import workers  # noqa: F401  (first: it blocks JAX before anything can import it)

# isort: split
import torch

import snapshard
import snapshard.torch as st
from snapshard.cli import main as cli
from snapshard.tree import flatten
from workers._dist import report


def main() -> None:
    root = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    state = {"model": model.state_dict(), "step": 7, "extra": [torch.arange(5)]}
    zeros = {
        "model": collections.OrderedDict(
            (k, torch.zeros_like(v)) for k, v in state["model"].items()
        ),
        "step": 0,
        "extra": [torch.zeros(5, dtype=torch.int64)],
    }
    st.save(os.path.join(root, "sync"), state)
    st.save_async(os.path.join(root, "async"), state).wait()
    loaded = [st.load(os.path.join(root, name), zeros) for name in ("sync", "async")]
    with st.CheckpointManager(os.path.join(root, "managed")) as m:
        m.save(1, state)
        m.wait_until_finished()
        managed = m.restore(1, zeros)
    as_numpy = snapshard.load(os.path.join(root, "sync"))
    exact = [
        all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
        and got["step"] == 7
        and torch.equal(got["extra"][0], state["extra"][0])
        for got in [*loaded, managed]
    ]
    report(
        exact=exact,
        numpy_weight=as_numpy["model"]["weight"].tolist(),
        weight=state["model"]["weight"].tolist(),
        structure=flatten(state, lambda x: isinstance(x, torch.Tensor | int)).structure,
        metadata_leaves=len(st.metadata(os.path.join(root, "sync"))["model"]),
        cli=[
            cli(["verify", os.path.join(root, "sync")]),
            cli(["info", os.path.join(root, "sync")]),
        ],
        jax_imported="jax" in sys.modules,
    )


if __name__ == "__main__":
    main()
