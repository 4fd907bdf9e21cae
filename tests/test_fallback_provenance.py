"""validate_front's fallbacks write the provenance of the policy they write: when the winner's
certificate does not pass, the saved ``tuned:`` section has the written policy's own speed-up,
loss, memory, fp8_runs_bf16, verdict (saying whose certificate did not pass and why) and
certificate, never the rejected winner's."""

from __future__ import annotations

import copy

import pytest
from tasks import small_gpt2_task

import autoprec
import autoprec.certification
from autoprec.policy import Interval
from autoprec.tuning import tune, validate_front

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One real tune, priced on the h100 cost model (exact, so the front is the same every run):
    its winner and at least one other distinct policy on the Pareto front."""
    out = tmp_path_factory.mktemp("tune") / "small.yaml"
    res = tune(small_gpt2_task(), formats=("fp32", "bf16", "fp8"), target="h100", n_trials=6,
               seed=1, output=str(out), progress=False)
    others = [t for t in res.pareto if t.assignment != res.best.assignment]
    assert others, "the front has no second distinct policy to fall back to"
    return res


def _fp8_runs_bf16(policy, prof):
    return {lp.fqn: lp.fp8_blocker for lp in prof.layers
            if lp.fp8_blocker and policy.format_for(lp.fqn).is_scaled}


def test_fallback_to_the_next_front_policy_writes_its_own_provenance(tuned, tmp_path,
                                                                     monkeypatch):
    res = copy.deepcopy(tuned)
    winner, winner_tuned = res.best, dict(res.policy.tuned)
    real = autoprec.certification.certify
    calls = []

    def certify(task, policy, **kw):
        # the real certificate: the winner's policy (a repeat of it too: the same policy) under
        # a tolerance nothing meets (beat bf16 by half), any other under one any finite run meets
        same = dict(policy.layers) == dict(winner_policy.layers) and \
            policy.default == winner_policy.default
        calls.append(same)
        return real(task, policy, **{**kw, "tolerance": -0.5 if same else 0.99})

    winner_policy = res.policy
    monkeypatch.setattr(autoprec.certification, "certify", certify)
    res = validate_front(res, small_gpt2_task(), steps=2, max_candidates=5, progress=False)
    assert res.validation is not None and res.validation.passed
    written = res.best
    assert written.assignment != winner.assignment
    path = tmp_path / "fallback.yaml"
    res.save(path, plot=False)
    pol = autoprec.load_policy(path)
    prov, tuned_ = pol.provenance, pol.tuned

    sel = res.selection
    own = sel.speedup.get(written.number, written.speedup)
    assert prov.speedup == Interval.from_value(own.to_dict())  # as written (rounded)
    assert prov.speedup != Interval.from_value(winner_tuned["speedup_vs_fp32"])
    assert prov.loss_increase == round(written.loss_increase, 6)
    assert prov.grad_error == round(written.grad_error, 6)
    assert tuned_.get("memory", {}).get("predicted_peak_bytes") == written.memory
    assert written.memory != winner.memory  # (so the line above can tell them apart)
    assert tuned_.get("fp8_runs_bf16", {}) == _fp8_runs_bf16(pol, res.profile)
    assert "improvement_over_warm_start" not in tuned_
    # the verdict: validation rejected the winner (named, its gap vs allowed), and why this one
    verdict = " ".join(prov.verdict)
    assert f"the certificate of trial {winner.number}, the tune's winner" in verdict
    assert "did not pass: FAIL" in verdict and f"wrote trial {written.number}" in verdict
    # the written policy carries its own certificate, which covers it as written
    cert, covers = pol.certified()
    assert covers and cert.verdict == "pass" and cert.tolerance == 0.99
    assert not set(prov.verdict) & set(winner_tuned.get("verdict", []))
    val = tuned_["validation"]
    assert val["passed"] is True and val["trial"] == written.number
    assert [r["trial"] for r in val["rejected"]] == [winner.number]
    assert val["rejected"][0]["verdict"] == "fail"
    # the study and where it was tuned are the tune's
    assert tuned_["study"] == winner_tuned["study"] and prov.device == winner_tuned["device"]
    # a repeat of the winner on the front is the same policy: not validated again
    assert calls == [True, False]


def test_fallback_to_all_fp32_claims_no_speedup_of_the_rejected_winner(tuned, tmp_path):
    res = copy.deepcopy(tuned)
    winner, winner_tuned = res.best, dict(res.policy.tuned)
    # the real certificate under a tolerance no policy meets: every front policy fails
    res = validate_front(res, small_gpt2_task(), steps=2, tolerance=-0.5, progress=False)
    assert res.validation is None
    path = tmp_path / "fp32.yaml"
    res.save(path, plot=False)
    pol = autoprec.load_policy(path)
    prov, tuned_ = pol.provenance, pol.tuned
    assert pol.default.value == "fp32" and not pol.layers

    assert prov.speedup is None and "speedup_vs_fp32" not in tuned_
    assert prov.loss_increase == 0.0 and prov.grad_error == 0.0
    fp32 = next(t for t in tuned.trials if all(f == "fp32" for f in t.assignment.values()))
    assert tuned_.get("memory", {}).get("predicted_peak_bytes") == fp32.memory
    assert fp32.memory != winner.memory
    assert res.best.number == fp32.number
    for key in ("fp8_runs_bf16", "timing", "improvement_over_warm_start"):
        assert key not in tuned_, key
    verdict = " ".join(prov.verdict)
    assert f"the certificate of trial {winner.number}, the tune's winner" in verdict
    assert "wrote all-fp32" in verdict and "by definition" in verdict
    assert pol.provenance.certificate is None
    assert not set(prov.verdict) & set(winner_tuned.get("verdict", []))
    val = tuned_["validation"]
    assert val["passed"] is False and val["rejected"][0]["trial"] == winner.number
