"""Where a study lives: an Optuna storage from a URL, ``journal:PATH``, or SQLite beside the
policy. Several workers on one storage share one study."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import optuna

__all__ = ["open_storage", "StorageError"]

# Errors of workers racing to create Optuna's schema on a fresh database; the loser succeeds
# once the tables exist.
_RACE_MARKERS = ("IntegrityError", "already exists", "UniqueViolation", "database is locked")


class StorageError(ValueError):
    """A storage that cannot be opened; the message names it (password hidden) and the fix."""


def _shown(url: str) -> str:
    """The URL with any password hidden, for messages."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a database URL: show it as given
        return url


def open_storage(storage: str | None, default_path: str) -> tuple[Any, str]:
    """An Optuna storage from a URL, ``journal:<path>``, or None (SQLite at default_path).
    Returns the storage and its URL. A storage that cannot be opened is a one-line
    :class:`StorageError`."""
    if storage is None:
        storage = f"sqlite:///{os.path.abspath(default_path)}"
    try:
        if storage.startswith("journal:"):
            return _journal(storage.split(":", 1)[1]), storage
        return _rdb(storage), storage
    except StorageError:
        raise
    except ImportError as e:  # ModuleNotFoundError, or SQLAlchemy's "failed to import"
        name = f" {e.name!r}" if getattr(e, "name", None) else ""
        raise StorageError(f"Cannot open storage {_shown(storage)}: its database driver{name} "
                           "is not installed. Install it (psycopg[binary] for postgresql://, "
                           "pymysql for mysql+pymysql://).") from None
    except Exception as e:  # noqa: BLE001 - every failure to open is the storage's to report
        kind = type(e).__name__
        first = (str(e).strip().splitlines() or [""])[0][:300]
        if kind == "ArgumentError":
            fix = ("it is not a database URL; use sqlite:///PATH, postgresql://USER@HOST/DB, "
                   "mysql+pymysql://USER@HOST/DB or journal:PATH")
        else:
            fix = "check the host, port, database name and credentials, and that the server runs"
        raise StorageError(f"Cannot open storage {_shown(storage)} ({kind}: {first}): {fix}.") \
            from None


def _journal(path: str):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if not path:
        raise StorageError("Storage `journal:` names no file; write journal:PATH.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise StorageError(f"Cannot open storage journal:{path}: folder {folder} does not exist.")
    return JournalStorage(JournalFileBackend(path))


def _rdb(url: str):
    if url.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(url[len("sqlite:///"):]) or ".", exist_ok=True)
    # heartbeat: a worker killed mid-trial leaves a RUNNING trial; after the grace period the
    # next worker marks it FAILED instead of waiting for it forever.
    kwargs = dict(heartbeat_interval=30, grace_period=120,
                  engine_kwargs={} if url.startswith("sqlite") else {"pool_pre_ping": True})
    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*heartbeat_interval.*")
                return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as e:  # noqa: BLE001
            racing = any(m in f"{type(e).__name__} {e}" for m in _RACE_MARKERS)
            if attempt == 5 or not racing:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")
