"""A profile shared between worker processes through a real Optuna storage (SQLite): every
unit done exactly once, the same profile on every worker, and a dead worker's unit redone."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

import optuna
import pytest
from tasks import tiny_gpt2_task

from autoprec.profiling import profile, split_units
from autoprec.tuning.share import SharedUnits

FORMATS = ("fp32", "bf16")


def _storage(path: str):
    return optuna.storages.RDBStorage(f"sqlite:///{path}")


def _profile(db: str, worker: str, **share_kw):
    share = SharedUnits(_storage(db), "study", worker=worker, progress=False, **share_kw)
    return profile(tiny_gpt2_task(), formats=FORMATS, progress=False, repeats=2, budget_s=0.2,
                   share=share)


def _worker(db: str, worker: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    prof = _profile(db, worker)
    with open(out, "w") as f:
        json.dump(prof.to_dict(), f)


def _claims(db: str) -> list:
    return [s for s in _storage(db).get_all_studies() if ".profile." in s.study_name]


def _numbers(d: dict) -> dict:
    """The profile's measured content (timings differ between workers: each timed only its
    own units, and both read the same stored rows, so they must be equal too)."""
    return {k: d[k] for k in ("layers", "units", "formats", "sensitivity_mode")}


def test_split_units_keeps_parents_with_their_children():
    fqns = ["h.0.attn", "h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj",
            "h.1.attn", "h.1.attn.c_attn", "h.1.attn.c_proj", "lm_head"]
    units = split_units(fqns, n=8)
    assert [f for u in units for f in u] == fqns
    for u in units:
        for f in u:
            parent = f.rpartition(".")[0]
            assert parent not in fqns or parent in u, units
    assert len(split_units(fqns * 10, n=4)) <= 5
    # a capture lists a module's children first when they run first (HF Llama's attention
    # projections, then the attention): the parent still goes with them, and so does a
    # grandchild listed under an unlisted middle module
    fqns = ["l.0.attn.q", "l.0.attn.k", "l.0.attn.v", "l.0.attn", "l.0.attn.o", "l.0.mlp.up",
            "l.0.mlp.down", "l.1.attn.q", "l.1.attn.k", "l.1.attn.v", "l.1.attn", "l.1.attn.o",
            "l.1.blk", "l.1.blk.a.b", "head"]
    units = split_units(fqns, n=8)
    assert [f for u in units for f in u] == fqns
    assert len(units) > 3, units
    for u in units:
        for f in u:
            for parent in (g for g in fqns if f.startswith(g + ".")):
                assert parent in u, units


def test_a_profile_in_units_is_the_profile_in_one():
    """HF Llama lists each attention's projections before the attention itself; a unit that
    held the attention without them switched them with it (and its gradient check failed:
    nan), so a tune's shared profile differed from a profile in one unit."""
    from conftest import byte_batches, tiny_llama

    import autoprec

    task = autoprec.Task(model=tiny_llama, batches=byte_batches(2, 2, 32, seed=4))

    def in_units(units, work):
        assert len(units) > 1
        return [r for u in units for r in work(u)], [{"layers": len(u)} for u in units]

    numbers = []
    for share in (None, in_units):
        prof = profile(task, FORMATS, target="h100", sensitivity="fast", progress=False,
                       share=share)
        numbers.append({(r.layer.fqn, f): (s.loss_rel_change, s.grad_rel_error)
                        for r in prof.layers for f, s in r.sensitivity.items()})
    assert any(fqn.endswith("self_attn") for fqn, _ in numbers[0])
    assert numbers[1] == numbers[0]


@pytest.mark.slow
def test_two_workers_split_the_profile_and_every_unit_is_done_once(tmp_path):
    db = str(tmp_path / "study.db")
    _storage(db)  # create the schema once, before the workers race
    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"w{i}.json") for i in range(2)]
    procs = [ctx.Process(target=_worker, args=(db, f"w{i}", outs[i])) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    profs = [json.load(open(o)) for o in outs]
    assert _numbers(profs[0]) == _numbers(profs[1])
    units = profs[0]["units"]
    claims = _claims(db)
    # every unit claimed once and finished once: no duplicate, none lost
    assert len(claims) == len(units) and all("rows" in c.user_attrs for c in claims)
    assert all(u["tries"] == 1 for u in units), units
    assert sum(u["layers"] for u in units) == len(profs[0]["layers"])
    print("units by worker:", [u["by"] for u in units])


def test_a_dead_workers_unit_is_redone_once_its_lease_runs_out(tmp_path):
    db = str(tmp_path / "study.db")
    storage = _storage(db)
    # a worker claimed unit 0 and died: it beat once, then never again
    n = len(split_units([lp for lp in _probe_fqns()]))
    sid = storage.create_new_study(directions=[optuna.study.StudyDirection.MINIMIZE],
                                   study_name=f"study.profile.u000of{n:03d}.try0")
    storage.set_study_user_attr(sid, "by", "dead:1")
    storage.set_study_user_attr(sid, "alive", time.time())
    t0 = time.perf_counter()
    prof = _profile(db, f"live:{os.getpid()}", lease_s=3.0, beat_s=0.5, poll_s=0.2)
    waited = time.perf_counter() - t0
    assert prof.units[0]["tries"] == 2 and prof.units[0]["by"] == f"live:{os.getpid()}"
    assert all(u["tries"] == 1 for u in prof.units[1:]), prof.units
    done = [c for c in _claims(db) if "rows" in c.user_attrs]
    assert len(done) == n, [c.study_name for c in done]
    assert waited >= 3.0  # it did not take the unit while the lease was still running
    assert {lp.fqn for lp in prof.layers} == set(_probe_fqns())


def _probe_fqns() -> list[str]:
    from autoprec.measure.capture import capture
    from autoprec.runtime.calls import COMPUTING_KINDS

    task = tiny_gpt2_task()
    model = task.build_model()
    graph = capture(model, task.model_call(model, task.example_batch()))
    return [L.fqn for L in graph.layers if L.kind in COMPUTING_KINDS and L.flops > 0]


def test_a_study_profiled_for_other_layers_is_a_one_line_error(tmp_path):
    db = str(tmp_path / "study.db")
    storage = _storage(db)
    n = len(split_units(_probe_fqns()))
    for i in range(n):  # every unit finished, by a worker that profiled another model
        sid = storage.create_new_study(directions=[optuna.study.StudyDirection.MINIMIZE],
                                       study_name=f"study.profile.u{i:03d}of{n:03d}.try0")
        storage.set_study_user_attr(sid, "layers", [f"other.{i}"])
        storage.set_study_user_attr(sid, "by", "elsewhere:1")
        storage.set_study_user_attr(sid, "rows", "[]")
    with pytest.raises(ValueError, match="profile different models; give this tune its own"):
        _profile(db, "here:1")
