"""How every rank of a torchrun run agrees to stop for a signal after the same step.

:class:`hydra_train.run_guard.RunSignals` hands a first Ctrl-C or SIGTERM during the loop to
``Trainer.interrupt``, which only records it; the loop stops at a step boundary, the step is saved
and the signal's exception raised (trainer.py). One process stops at the first boundary after the
signal. Under torchrun each rank must stop after the same step: the save and the evaluation are
collectives, and a rank checking its own flag alone could stop while another enters the next
step's collectives. torchrun forwards the signal to every rank, but not at the same instant: the
ranks can be a step apart when it lands, and a rank may get none (a signal sent to one process).

The stop requests of ``Trainer.request_stop`` are agreed at log steps (``--log_every``), where the
ranks sync anyway. That is too slow for an interrupt: torchrun kills its workers 30 s after
forwarding a signal (``--shutdown_timeout``), a cluster soon after its SIGTERM, and production's
``--log_every 50`` of multi-second steps is minutes. So the ranks vote every step, through
:class:`InterruptVote`: one all-reduce (max) of a one-element tensor holding the rank's signal
number, read one step later. Every rank reads the same result at the same boundary, so they stop
together, one or two steps after the signal. Reading it a step later costs no host sync on a GPU:
the result is copied to pinned memory behind the vote and an event waits for that copy alone,
which is done once the previous step's kernels are (the current step's stay queued). The largest
signal number wins (SIGTERM over SIGINT), so every rank ends with the same exit status.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class InterruptVote:
    """Each step boundary's vote of the ranks on an interrupt, read at the next boundary."""

    def __init__(self, device: torch.device) -> None:
        self._vote = torch.zeros(1, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        # on a GPU the result goes to pinned memory, and an event marks when it is there
        self._result = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else self._vote
        self._ready = torch.cuda.Event() if cuda else None
        self._cast = False  # a vote is out, not read yet

    def agreed_then_vote(self, signum: int | None) -> int | None:
        """The signal the ranks agreed on at the previous boundary (None: none, or no vote out);
        when there is none, this boundary's vote is cast with this rank's ``signum``. Every rank
        must call it at every boundary (it is a collective)."""
        agreed = None
        if self._cast:
            if self._ready is not None:
                self._ready.synchronize()
            agreed = int(self._result[0]) or None
            self._cast = False
        if agreed is None:  # once agreed, the loop stops: no further vote (every rank skips it)
            self._vote.fill_(signum or 0)
            dist.all_reduce(self._vote, op=dist.ReduceOp.MAX)  # NCCL: queued, no host wait
            if self._ready is not None:
                self._result.copy_(self._vote, non_blocking=True)
                self._ready.record()
            self._cast = True
        return agreed
