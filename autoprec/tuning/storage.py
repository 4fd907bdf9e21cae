"""Where a study lives: an Optuna storage from a URL, ``journal:PATH``, or SQLite beside the
policy. Several workers on one storage share one study."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import optuna

from autoprec._util import shown, unwritable_folder

__all__ = ["open_storage", "check_storage", "storage_file", "StorageError", "StudyHandle"]

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


def storage_file(storage: str | None, default_path: str) -> str | None:
    """The local file a storage keeps its studies in (SQLite, a journal), or None (a database
    server, an in-memory SQLite)."""
    if storage is None:
        return os.path.abspath(default_path)
    if storage.startswith("journal:"):
        return storage.split(":", 1)[1] or None
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):].split("?", 1)[0]
        return None if path in ("", ":memory:") or path.startswith("file:") else path
    return None


def check_storage(storage: str | None, default_path: str) -> None:
    """Refuse, before any work, a storage whose file cannot be written: under a path that is
    not a folder, a folder, a read-only file, or in a folder that cannot be written (SQLite and
    the journal write files beside the study). A one-line :class:`StorageError`."""
    path = storage_file(storage, default_path)
    if path is None:
        return
    url = _shown(storage) if storage is not None else f"sqlite:///{path}"
    where = f"Cannot use storage {url}"
    if os.path.isdir(path):
        raise StorageError(f"{where}: {path} is a folder; name the study's file.")
    problem = unwritable_folder(path)
    if problem is not None and problem[1] == "file":
        raise StorageError(f"{where}: {problem[0]} is a file, not a folder; choose another path.")
    if problem is not None:
        raise StorageError(f"{where}: the folder {problem[0]} is not writable, and the study's "
                           "file (and the lock or journal files beside it) must be written there; "
                           "choose another path or make the folder writable.")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise StorageError(f"{where}: the file {path} is read-only, and a tune writes its "
                           "trials there; make it writable (chmod u+w) or give another "
                           "--storage (or -o, for the default study beside the policy).")


def open_storage(storage: str | None, default_path: str) -> tuple[Any, str]:
    """An Optuna storage from a URL, ``journal:<path>``, or None (SQLite at default_path).
    Returns the storage and its URL. A storage that cannot be opened is a one-line
    :class:`StorageError`."""
    check_storage(storage, default_path)
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
        elif "database is locked" in first:
            fix = _LOCKED
        elif "readonly" in first or "read-only" in first:
            fix = "the database is read-only; make it writable or give another --storage"
        elif "no longer compatible with the table schema" in first:
            fix = _schema_fix(first)
        else:
            fix = "check the host, port, database name and credentials, and that the server runs"
        raise StorageError(f"Cannot open storage {_shown(storage)} ({kind}: {shown(first)}): "
                           f"{fix}.") from None


def _schema_fix(said: str) -> str:
    """What to do about a study whose tables another Optuna version set up (Optuna says which
    one: "set up by optuna X"): a newer one's study is read by that version; an older one's
    is upgraded by Optuna's own command."""
    import re

    found = re.search(r"set up by optuna ([0-9][0-9A-Za-z.+-]{0,40})", said)
    theirs = found.group(1) if found else None
    try:
        from packaging.version import Version

        newer = theirs is not None and Version(theirs) > Version(optuna.__version__)
    except Exception:  # noqa: BLE001 - an unparseable version: say both ways out
        newer = None
    if newer:
        return (f"the study was written by optuna {theirs}, newer than this optuna "
                f"{optuna.__version__}; run the tune with optuna {theirs} or newer (pip install "
                f"'optuna>={theirs}'), or give this tune another --storage (or -o)")
    return ("the study's tables are from another optuna version; upgrade them with `optuna "
            "storage upgrade --storage URL` (back the file up first), or give this tune another "
            "--storage (or -o)")


@dataclass(frozen=True)
class StudyHandle:
    """An open study and where it lives: the storage object it was opened on and its URL, kept
    here rather than recovered from the study (Optuna keeps its storage private)."""

    study: optuna.Study
    storage: Any
    url: str

    @property
    def name(self) -> str:
        return self.study.study_name

    def fail(self, number: int) -> None:
        """Mark trial ``number`` of the study failed (a RUNNING trial a worker left behind)."""
        sid = self.storage.get_study_id_from_name(self.name)
        tid = self.storage.get_trial_id_from_study_id_trial_number(sid, number)
        self.storage.set_trial_state_values(tid, state=optuna.trial.TrialState.FAIL)


def _journal(path: str):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if not path:
        raise StorageError("Storage `journal:` names no file; write journal:PATH.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise StorageError(f"Cannot open storage journal:{path}: folder {folder} does not exist.")
    return JournalStorage(JournalFileBackend(path))


_LOCKED = ("the database is locked: another process holds a lock on it (another tune writing "
           "it, or a program with a transaction open on it). Wait for it to finish or close "
           "it, then rerun; or give this tune another --storage (or -o)")


def _sqlite_unlocked(url: str) -> None:
    """Refuse, in one line, an SQLite study another process holds locked: Optuna would wait
    for it at every one of its first statements and retry, then fail with a generic message."""
    import sqlite3

    path = storage_file(url, "")
    if path is None or not os.path.isfile(path):
        return
    try:
        # the same 5 s a writer waits for another's short transaction (sqlite3's default)
        con = sqlite3.connect(path, timeout=5.0, isolation_level=None)
    except sqlite3.Error:
        return  # Optuna's own open says what is wrong
    try:
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise StorageError(f"Cannot open storage {_shown(url)}: {_LOCKED}.") from None
    except sqlite3.DatabaseError as e:
        raise StorageError(f"Cannot open storage {_shown(url)}: {path} is not an SQLite "
                           f"database ({e}); give another --storage or -o.") from None
    finally:
        con.close()


def _rdb(url: str):
    if url.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(url[len("sqlite:///"):]) or ".", exist_ok=True)
        _sqlite_unlocked(url)
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
