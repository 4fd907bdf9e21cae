"""A profile split between workers through the study's storage, as trials already are.

The profile's layers are cut into a fixed number of units (:func:`autoprec.profiling.
split_units`). A worker claims a unit by *creating* a study named after it in the storage:
creation is atomic in every Optuna storage (a second create of the same name raises
``DuplicatedStudyError``), so no unit is ever worked on by two live workers. While it works,
the worker writes a heartbeat into that study's attributes; when it finishes, the unit's rows.

```
<study>.profile.u003of008.try0   claimed by host:123, alive 12:00:05, rows: [...]   done
<study>.profile.u004of008.try0   claimed by host:456, alive 11:58:40 (stale)        dead
<study>.profile.u004of008.try1   claimed by host:789, alive 12:00:06                running
```

A worker killed mid-unit stops beating; once its heartbeat is older than the lease, any
worker claims the next try of that unit and redoes it: a unit is never lost, and done once
(unless a live worker stalls longer than the lease, which the lease is sized against).
Every worker returns the same rows: the finished try of each unit, read from the storage.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import optuna

from autoprec._util import log as _log
from autoprec._util import shown

__all__ = ["SharedUnits", "unit_studies"]

_NAME = re.compile(r"\.profile\.u(\d+)of(\d+)\.try(\d+)$")


def unit_studies(name: str) -> bool:
    """Whether a study name is one of a shared profile's unit claims."""
    return _NAME.search(name) is not None


class SharedUnits:
    """Runs a profile's units with every other worker that runs it on the same storage and
    study (a :data:`autoprec.profiling.UnitRunner`)."""

    def __init__(self, storage: Any, study_name: str, *, worker: str, lease_s: float = 60.0,
                 beat_s: float = 5.0, poll_s: float = 2.0, progress: bool = True):
        if not 0 < beat_s < lease_s:
            raise ValueError(f"The heartbeat ({beat_s} s) must be shorter than the lease "
                             f"({lease_s} s).")
        # one "A new study created" line per claimed unit would drown the progress output
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.storage, self.prefix, self.worker = storage, f"{study_name}.profile", worker
        self.lease_s, self.beat_s, self.poll_s = lease_s, beat_s, poll_s
        self.log = lambda msg: _log(msg, progress)
        # claims seen without a heartbeat yet: when first seen (a worker killed between the
        # claim and its first beat is stale a lease after that)
        self._first_seen: dict[str, float] = {}

    def __call__(self, units: list[list[str]], work: Callable[[list[str]], list[dict]]
                 ) -> tuple[list[dict], list[dict]]:
        n = len(units)
        waiting_said = False
        while True:
            state = self._state(n)
            done = [i for i in range(n) if state[i]["rows"] is not None]
            if len(done) == n:
                break
            free = [i for i in range(n) if i not in done and not state[i]["running"]]
            claimed = next((i for i in free if self._claim(i, n, state[i]["tries"], units[i],
                                                           work)), None)
            if claimed is None:
                if not waiting_said:
                    running = sum(1 for i in range(n) if state[i]["running"])
                    self.log(f"profile: {len(done)}/{n} units done, {running} being profiled "
                             "by other workers; waiting for them")
                    waiting_said = True
                time.sleep(self.poll_s)
        rows, who = [], []
        for i in range(n):
            unit = state[i]
            if unit["layers"] != units[i]:
                # the user's doing (one --study for two models), so a one-line error
                raise ValueError(f"Unit {i} of the shared profile in {self.prefix} covers "
                                 "other layers than this worker's: the workers profile "
                                 "different models; give this tune its own --study.")
            rows.extend(unit["rows"])
            who.append({"layers": len(units[i]), "by": unit["by"], "tries": unit["tries"]})
        return rows, who

    # ------------------------------------------------------------------ storage
    def _state(self, n: int) -> list[dict]:
        """Per unit: its finished rows (or None), who did them, how many tries were claimed,
        and whether a live worker is on it."""
        out = [{"rows": None, "by": None, "tries": 0, "running": False, "layers": None}
               for _ in range(n)]
        now = time.time()
        for s in self.storage.get_all_studies():
            m = _NAME.search(s.study_name)
            if not s.study_name.startswith(self.prefix + ".") or m is None or int(m[2]) != n:
                continue
            unit = out[int(m[1])]
            unit["tries"] = max(unit["tries"], int(m[3]) + 1)
            attrs = s.user_attrs
            if "rows" in attrs:
                unit.update(rows=json.loads(attrs["rows"]), by=attrs.get("by"),
                            layers=attrs.get("layers"))
                continue
            alive = attrs.get("alive") or self._first_seen.setdefault(s.study_name, now)
            unit["running"] = unit["running"] or now - alive < self.lease_s
        return out

    def _claim(self, i: int, n: int, tries: int, layers: list[str],
               work: Callable[[list[str]], list[dict]]) -> bool:
        """Claim try ``tries`` of unit ``i`` and do it; False when another worker claimed it
        first."""
        name = f"{self.prefix}.u{i:03d}of{n:03d}.try{tries}"
        try:
            sid = self.storage.create_new_study(
                directions=[optuna.study.StudyDirection.MINIMIZE], study_name=name)
        except optuna.exceptions.DuplicatedStudyError:
            return False
        self.storage.set_study_user_attr(sid, "by", self.worker)
        self.storage.set_study_user_attr(sid, "layers", layers)
        if tries:
            self.log(f"profile: redoing unit {i + 1}/{n} (try {tries + 1}): the worker on it "
                     f"stopped beating for {self.lease_s:.0f} s")
        plural = "" if len(layers) == 1 else "s"
        self.log(f"profile: unit {i + 1}/{n} ({len(layers)} layer{plural}: {shown(layers[0])}"
                 f"{' ...' if len(layers) > 1 else ''})")
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(sid, stop), daemon=True)
        beat.start()
        try:
            rows = work(layers)
        finally:
            stop.set()
            beat.join()
        self.storage.set_study_user_attr(sid, "rows", json.dumps(rows))
        return True

    def _beat(self, sid: int, stop: threading.Event) -> None:
        while True:
            self.storage.set_study_user_attr(sid, "alive", time.time())
            if stop.wait(self.beat_s):
                return
