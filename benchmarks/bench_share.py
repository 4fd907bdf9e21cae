"""A profile shared by two workers on one study, against one worker alone, in one run.

GPT-2 8x384 (batch 8x128), default profile settings, SQLite storage. Every worker is its own
process with one thread (OMP/MKL and torch threads = 1):

1. one worker alone;
2. two workers started together;
3. two workers, one killed (SIGKILL) while it works on a unit and restarted at once: its unit
   is redone after the lease (20 s here, 60 s in a tune) runs out.

Printed: wall time to the whole profile, the ratio to case 1, and the unit count (claims
finished, tries per unit): every unit finished exactly once. Target: case 2 <= 0.6x case 1.

    python benchmarks/bench_share.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401
import optuna
from _common import ROOT, device_line, print_table

WORKER = """
import json, sys, time, warnings
sys.path.insert(0, {root!r})
warnings.filterwarnings("ignore")
import optuna, torch
torch.set_num_threads(1)
from autoprec.profiling import profile
from autoprec.tuning.share import SharedUnits
from examples.gpt2_bytes import task
storage = optuna.storages.RDBStorage("sqlite:///{db}")
share = SharedUnits(storage, "bench", worker={name!r}, lease_s=20.0, beat_s=2.0, progress=False)
t0 = time.perf_counter()
prof = profile(task(n_layer=8, n_embd=384, batch_size=8, seq_len=128), progress=False,
               share=share)
print("RESULT " + json.dumps({{"wall": time.perf_counter() - t0, "units": prof.units}}))
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def start(db: str, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER.format(root=ROOT, db=db, name=name)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate()
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"worker failed:\n{err[-2000:]}")
    return json.loads(line[len("RESULT "):])


def claims(db: str) -> list:
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    return [s for s in storage.get_all_studies() if ".profile." in s.study_name]


def counts(db: str, units: list[dict]) -> str:
    done = [c for c in claims(db) if "rows" in c.user_attrs]
    tries = [u["tries"] for u in units]
    by: dict[str, int] = {}
    for u in units:
        by[u["by"]] = by.get(u["by"], 0) + 1
    return (f"{len(done)} finished claims for {len(units)} units; tries {tries}; "
            f"units by worker {by}")


def case(db: str, names: list[str], kill_after_claim: bool = False) -> tuple[float, list]:
    optuna.storages.RDBStorage(f"sqlite:///{db}")  # the schema, before the workers race
    t0 = time.perf_counter()
    procs = [start(db, n) for n in names]
    if kill_after_claim:
        victim = procs[0]
        while not any(c.user_attrs.get("by") == names[0] and "rows" not in c.user_attrs
                      for c in claims(db)):
            time.sleep(0.5)
        time.sleep(3.0)  # well inside its unit
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        procs[0] = start(db, names[0] + "-restarted")
    results = [result(p) for p in procs]
    wall = time.perf_counter() - t0
    return wall, results[-1]["units"]


def main():
    print(device_line())
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for label, names, kill in (("one worker", ["w1"], False),
                                   ("two workers", ["w1", "w2"], False),
                                   ("two workers, w1 killed and restarted", ["w1", "w2"], True)):
            db = os.path.join(tmp, f"{len(rows)}.db")
            wall, units = case(db, names, kill)
            base = base or wall
            rows.append([label, f"{wall:.1f}", f"{wall / base:.2f}", counts(db, units)])
    print_table(rows, ["case", "wall s", "/ one worker", "units"])
    print("one thread per worker; lease 20 s (a killed worker's unit waits for it)")


if __name__ == "__main__":
    main()
