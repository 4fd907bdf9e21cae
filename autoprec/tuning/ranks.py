"""A tune of a model FSDP2 shards, on every rank of a ``torchrun``.

Rank 0 runs the search: the study and its sampler, each trial's price, the verdict and the
files. A trial's numerics are FSDP2 forwards and backwards that every rank takes part in, so
rank 0 announces each comparison before it runs it and the other ranks run the same one
beside it (:func:`follow`); at the end every rank returns rank 0's result. What rank 0 decides
alone (a stored profile, whether to keep held-out gradients) reaches the others the same way
(:func:`decided`), and so does its error: the others stop in one line instead of waiting.
Nothing else a tune does runs collectives after the evaluator's reference: the price comes
from the cost model and the memory model is not calibrated on a sharded model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from autoprec._util import shown
from autoprec.measure import shards
from autoprec.policy import Policy

__all__ = ["decided", "lead", "follow"]


def decided(model: nn.Module, decide: Callable[[], Any]) -> Any:
    """``decide()`` run by rank 0 alone, its value on every rank measuring ``model``
    (``decide()`` itself in one process). An error in it reaches the other ranks as a one-line
    RuntimeError, instead of leaving them in a collective rank 0 will never run."""
    rank, n = shards.ranks(model)
    if n == 1:
        return decide()
    if rank != 0:
        return follow(None, model)
    try:
        value = decide()
    except BaseException as e:
        shards.broadcast(("failed", f"{type(e).__name__}: {e}"), model)
        raise
    shards.broadcast(("ok", value), model)
    return value


def lead(ev: Any, search: Callable[[], Any]) -> Any:
    """Rank 0's search (``search()``) on ``ev``, an :class:`~autoprec.tuning.evaluate.Evaluator`
    of a sharded model: each comparison it runs is announced first, so the other ranks
    (:func:`follow`) run it beside rank 0; its result, or its error, ends theirs."""
    model = ev.meter.model
    if shards.ranks(model)[1] > 1:
        ev.announce = lambda policy: shards.broadcast(("deviation", policy), model)
    return decided(model, search)


def follow(deviation: Callable[[Policy], Any] | None, model: nn.Module) -> Any:
    """A rank other than 0: run each comparison rank 0 announces (``deviation(policy)``, this
    rank's evaluator's) until rank 0 is done, and return rank 0's value."""
    while True:
        what, value = shards.broadcast(None, model)
        if what == "deviation" and deviation is not None:
            deviation(value)
        elif what == "ok":
            return value
        else:
            raise RuntimeError(f"rank 0 of the sharded tune stopped ({shown(value, 300)}); "
                               "this rank stops with it: see rank 0's output.")
