"""The certificate (autoprec.certification): paired branches from one reference run judge whether a
policy trains like its reference. Both sides of the verdict on a real HF Llama byte LM: a
planted effect it must find (round-to-nearest NVFP4 on every Linear fails), nulls it must not
reject (BF16 against itself passes with a zero gap, FP32 against BF16 does not fail), and the
sequential stop against the full run. Then the record a policy carries: checked when read,
shown, compared, and no longer covering a policy edited after certification."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
from tasks import tiny_gpt2_task, tiny_llama_task

from autoprec import Policy, PolicyError, certify, load_policy
from autoprec.certificate import Certificate
from autoprec.certification import DEFAULT_TOLERANCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "tasks.py")
AUTOPREC = shutil.which("autoprec", path=os.path.dirname(sys.executable)) or "autoprec"
LINEARS = ("model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head")
STEPS = 120  # a reference run of 120 steps, branches of 60


def every_linear(fmt: str) -> Policy:
    return Policy(default="bf16", layers=dict.fromkeys(LINEARS, fmt))


@pytest.fixture(scope="module")
def runs(one_thread):
    """Certificates of the tiny Llama, each measured once per (policy, sequential)."""
    cache: dict[tuple[str, bool], object] = {}
    task = tiny_llama_task()

    def run(name: str, sequential: bool = True):
        if (name, sequential) not in cache:
            policy = Policy(default=name) if name in ("bf16", "fp32") else every_linear(name)
            cache[name, sequential] = certify(task, policy, steps=STEPS, sequential=sequential,
                                              progress=False)
        return cache[name, sequential]

    yield run


# ============================================================================ the verdicts
@pytest.mark.slow
def test_round_to_nearest_nvfp4_on_every_linear_fails(runs):
    cert = runs("nvfp4:plain").certificate
    assert cert.verdict == "fail", cert.describe()
    assert cert.low > DEFAULT_TOLERANCE and all(g > 0 for g in cert.gaps), cert.describe()


def test_bf16_against_itself_passes_with_a_zero_gap_and_stops_at_the_first_look(runs):
    cert = runs("bf16").certificate
    assert cert.verdict == "pass" and cert.gap == cert.low == cert.high == 0.0, cert.describe()
    assert cert.stopped_early and cert.branches == 4 and cert.policy_steps == 4 * STEPS // 2


@pytest.mark.slow
def test_fp32_against_bf16_does_not_fail(runs):
    cert = runs("fp32").certificate
    assert cert.verdict != "fail", cert.describe()
    assert abs(cert.gap) < DEFAULT_TOLERANCE / 2, cert.describe()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp32", "fp8", "nvfp4:plain"])
def test_the_sequential_stop_never_contradicts_the_full_run(runs, name):
    seq, full = runs(name, True), runs(name, False)
    assert {seq.verdict, full.verdict} != {"pass", "fail"}, (seq.certificate.describe(),
                                                             full.certificate.describe())
    if seq.verdict != "undecided":
        assert full.verdict in (seq.verdict, "undecided")
    # the branches both ran are the same pairs: the same losses, to the bit
    for start, losses in seq.losses.items():
        assert full.losses[start] == losses, start
    assert full.certificate.branches == 8 and not full.certificate.stopped_early


# ============================================================================ the record
def _cert(**changes) -> Certificate:
    fields = dict(reference="bf16", digest=Policy(default="bf16").digest(), design="branches",
                  steps=200, horizon=100, branches=8, tokens=51200, policy_steps=800,
                  gap=0.001, low=-0.002, high=0.004, confidence=0.975, tolerance=0.005,
                  verdict="pass", held_equal=("init", "batches"),
                  gaps=(0.001,) * 8, stopped_early=False)
    fields.update(changes)
    return Certificate(**fields)


def test_a_certificate_reads_back_as_written_through_a_policy_file(tmp_path):
    policy = Policy(default="bf16", layers={"lm_head": "fp32"})
    cert = _cert(digest=policy.digest())
    path = tmp_path / "p.yaml"
    policy.with_certificate(cert).save(path)
    back = load_policy(path)
    assert back.provenance.certificate == cert and back.certified() == (cert, True)


@pytest.mark.parametrize("bad, needle", [
    ({"verdict": "fail"}, "says 'fail'"),                  # its own interval says pass
    ({"gap": 0.5}, "not inside its interval"),
    ({"branches": 10 ** 6}, "at most"),
    ({"held_equal": ["everything"]}, "held_equal"),
    ({"gaps": "many"}, "gaps"),
    ({"confidence": 1.5}, "between 0 and 1"),
    ({"extra\x1b[2J": 1}, "unknown key"),
])
def test_a_bad_certificate_in_a_policy_file_is_one_line(tmp_path, bad, needle):
    record = {**_cert().to_dict(), **bad}
    policy = Policy(default="bf16", tuned={"certificate": record})
    path = tmp_path / "p.yaml"
    policy.save(path)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    message = str(e.value)
    assert needle in message and "tuned.certificate" in message and "\n" not in message
    assert "\x1b" not in message


def cli(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([AUTOPREC, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_show_prints_the_certificate_and_says_when_an_edit_voids_it(tmp_path):
    policy = Policy(default="bf16", layers={"lm_head": "fp32"})
    certified = tmp_path / "certified.yaml"
    policy.with_certificate(_cert(digest=policy.digest())).save(certified)
    show = cli("show", certified)
    assert show.returncode == 0, show.stderr
    assert "certificate: PASS: gap vs bf16 +0.10% [-0.20%, +0.40%]" in show.stdout, show.stdout
    assert "NOT CERTIFIED" not in show.stdout
    edited = tmp_path / "edited.yaml"
    edited.write_text(certified.read_text().replace("lm_head: fp32", "lm_head: fp8"))
    show = cli("show", edited)
    assert "NOT CERTIFIED as it is" in show.stdout and "edited after" in show.stdout, show.stdout
    # diff names the certificates; only provenance differs between these two: exit 0
    plain = tmp_path / "plain.yaml"
    policy.save(plain)
    diff = cli("diff", plain, certified)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert "certificate: (none) -> PASS" in diff.stdout, diff.stdout
    diff = cli("diff", certified, edited)
    assert diff.returncode == 1 and "[edited since]" in diff.stdout, diff.stdout


@pytest.mark.slow
def test_validate_writes_the_certified_policy_and_never_over_its_input(tmp_path):
    policy = tmp_path / "fp32.yaml"
    Policy(default="fp32").save(policy)
    refused = cli("validate", policy, "--task", f"{TASKS}:tiny_gpt2_task", "-o", policy)
    assert refused.returncode == 2 and "would destroy" in refused.stderr, refused.stderr
    out = tmp_path / "certified.yaml"
    r = cli("validate", policy, "--task", f"{TASKS}:tiny_gpt2_task", "--steps", "16",
            "--reference", "fp32", "-o", out)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    cert, covers = load_policy(out).certified()
    assert covers and cert.verdict == "pass" and cert.reference == "fp32" and cert.gap == 0.0
    assert cert.steps == 16 and cert.horizon == 8


def test_the_interval_and_the_verdict_agree_on_both_sides():
    from autoprec.certificate import verdict_of

    assert verdict_of(-0.01, 0.004, 0.005) == "pass"
    assert verdict_of(0.006, 0.02, 0.005) == "fail"
    assert verdict_of(0.001, 0.009, 0.005) == "undecided"
    assert verdict_of(-math.inf, math.inf, 0.005) == "undecided"
    assert verdict_of(0.0, 0.0, 0.005, finite=False) == "fail"


def test_bad_arguments_are_one_line_errors():
    task = tiny_gpt2_task()
    for kw, needle in (({"steps": 1}, "steps >= 2"), ({"steps": 10, "horizon": 11}, "fit"),
                       ({"tolerance": 2.0}, "tolerance"), ({"min_branches": 9}, "exceeds")):
        with pytest.raises(ValueError, match=needle):
            certify(task, Policy(default="bf16"), progress=False, **kw)


def test_a_reference_that_diverges_is_an_error_not_a_verdict_on_the_policy():
    from tasks import overflow_gpt2_task

    # the planted layer overflows fp16: an all-fp16 reference goes non-finite
    with pytest.raises(ValueError, match="reference diverges"):
        certify(overflow_gpt2_task(), Policy(default="fp32"), reference="fp16", steps=4,
                progress=False)


def test_an_undecided_report_says_what_would_decide_it():
    from autoprec.certification import CertifyResult

    cert = _cert(gap=0.006, low=0.002, high=0.010, verdict="undecided", gaps=(0.006,) * 8)
    text = CertifyResult(certificate=cert, losses={0: (2.0, 2.012)}).report()
    assert "UNDECIDED" in text and "more branches" in text and "--steps" in text
    assert "more branches" not in CertifyResult(certificate=_cert()).report()


def test_a_loss_scaler_skipping_its_first_steps_trains_on_without_a_scheduler_warning():
    """An fp16 policy's GradScaler skips the steps whose scaled gradients overflow (seen on an
    H200: torch warned "lr_scheduler.step() before optimizer.step()" through a certificate). The
    schedule counts the skipped steps, as in the reference run, and nothing is printed."""
    import warnings

    import torch

    from autoprec import LossScaling
    from autoprec.certification import start_run, train_step

    task = tiny_gpt2_task()
    policy = Policy(default="fp16", loss_scaling=LossScaling(init_scale=2.0**50))
    run = start_run(task, policy, total_steps=4, strict=True)
    before = [p.detach().clone() for p in run.model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(task, run, task.batches[0], 0)
    assert run.scaler is not None and run.scaler.get_scale() < 2.0**50  # it overflowed
    assert all(torch.equal(a, b) for a, b in zip(before, run.model.parameters()))  # skipped
    assert run.schedule.last_epoch == 1
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], \
        [str(w.message) for w in caught]
