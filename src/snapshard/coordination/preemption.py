"""Agreement on the step a multi-process job saves at when it is preempted, over a Coordinator.

Where the framework has no preemption sync service (torch.distributed; JAX with its service
off), processes see SIGTERM or `notify_preemption()` at different steps, or only some see
it. Deciding each for itself, they would save at different steps: the first save would wait
for the others' reports and time out, with nothing saved. `PreemptionAgreement` makes them
decide on the same step through one key of the job's key-value store.
"""

from __future__ import annotations

from ..errors import CoordinationError
from .base import Coordinator


class PreemptionAgreement:
    """The step every process saves at when the job is preempted, agreed through one key.

    Protocol, at each process's `reached(step, signalled)` call:

    - a process that was signalled and knows of no agreed step proposes the step it is at,
      with `set_if_absent(key, step)`: the first proposal stays, and later proposers get it
      back;
    - any other process looks the key up (`try_get`) until it finds it;
    - once found, the proposed step P is cached (the store is not read again), and the
      answer is `step > P`: every process answers True at its first call past P.

    Assumption: every process calls `reached` at the same steps, and no process starts its
    call at step s+1 before every other one has finished its call at step s. This holds
    in synchronous training, with a collective between one call and the next (data or
    model parallel steps): the proposer publishes P at its call at P, before it enters the
    collective of step P+1, so every process finds P at its call at P+1 at the latest, and
    all answer True at P+1.

    What breaks the assumption and is seen: a process that finds P only after it answered
    False at a step past P (it ran more than one step ahead of the proposer, or the calls
    were missed) raises CoordinationError naming its rank, its step and P, rather than
    saving at another step than the others; it raises again at every later call. What is
    not seen: a process that stops calling before P is published, or processes that call at
    different steps (say one every step, another every second step).

    Cost: one lookup in the store per call until P is known (`set_if_absent` on a proposer),
    none after. Not thread-safe: call it from the training loop's thread.
    """

    def __init__(self, coordinator: Coordinator, key: str):
        self._coord = coordinator
        self.key = key
        self._agreed: int | None = None
        self._checked: int | None = None  # the newest step answered before P was known
        self._error: CoordinationError | None = None

    @property
    def agreed_step(self) -> int | None:
        """P, the step the first proposer published, once this process has seen it."""
        return self._agreed

    def reached(self, step: int, signalled: bool) -> bool:
        """Whether this process saves at `step`; `signalled`: it saw the preemption signal."""
        if self._error is not None:
            raise self._error
        if self._agreed is None:
            if signalled:
                value: str | None = self._coord.set_if_absent(self.key, str(step))
            else:
                value = self._coord.try_get(self.key)
            if value is None:
                self._checked = step if self._checked is None else max(self._checked, step)
                return False
            self._agreed = int(value)
            if self._checked is not None and self._checked > self._agreed:
                self._error = CoordinationError(
                    f"preemption: rank {self._coord.process_index} is at step {step} and only "
                    f"now finds the agreed preemption step {self._agreed} (every rank saves at "
                    f"its first step past it), but it already went past step {self._checked} "
                    f"without saving. The ranks ran more than one step apart: agreeing on a "
                    f"step needs every rank to call reached_preemption at the same steps, "
                    f"with a collective between one call and the next"
                )
                raise self._error
        return step > self._agreed
