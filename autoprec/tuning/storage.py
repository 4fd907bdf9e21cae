"""Where a study lives: an Optuna storage from a URL, ``journal:PATH``, or SQLite beside the
policy. Several workers on one storage share one study."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import optuna

__all__ = ["open_storage"]

# Errors of workers racing to create Optuna's schema on a fresh database; the loser succeeds
# once the tables exist.
_RACE_MARKERS = ("IntegrityError", "already exists", "UniqueViolation", "database is locked")


def open_storage(storage: str | None, default_path: str) -> tuple[Any, str]:
    """An Optuna storage from a URL, ``journal:<path>``, or None (SQLite at default_path).
    Returns the storage and its URL."""
    if storage is None:
        storage = f"sqlite:///{os.path.abspath(default_path)}"
    if storage.startswith("journal:"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = storage.split(":", 1)[1]
        return JournalStorage(JournalFileBackend(path)), storage
    if storage.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(storage[len("sqlite:///"):]) or ".", exist_ok=True)
    # heartbeat: a worker killed mid-trial leaves a RUNNING trial; after the grace period the
    # next worker marks it FAILED instead of waiting for it forever.
    kwargs = dict(heartbeat_interval=30, grace_period=120,
                  engine_kwargs={} if storage.startswith("sqlite") else {"pool_pre_ping": True})
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*heartbeat_interval.*")
                return optuna.storages.RDBStorage(storage, **kwargs), storage
        except Exception as e:  # noqa: BLE001
            racing = any(m in f"{type(e).__name__} {e}" for m in _RACE_MARKERS)
            if attempt == 5 or not racing:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")
