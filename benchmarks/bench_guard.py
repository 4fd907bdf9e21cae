"""Cost of the runtime guard when it has nothing to report, and of applying a policy under each
training integration.

HF GPT-2 (4 layers, 256 wide, batch 16x128), training steps (forward, backward, AdamW), all
variants of one table timed round-robin in one run:

    policy + guard            vs  the same policy, no guard            (target ratio <= 1.03)
      (the guard with its predictive check, the default; and with predict=False, the
      reactive check alone; and the one over the other: the predictive check's own cost)
    the same two, both under torch.compile (inductor)                  (target ratio <= 1.03)
    all-fp32 policy           vs  no policy, in a plain loop           (the pass's own cost)
    all-fp32 policy           vs  no policy, Accelerate-prepared (mixed_precision="no")
    PolicyCallback(all-fp32)  vs  no callback, steps inside HF Trainer.train() (runs of a few)

The guard's policy has bf16 and fp8 layers (fp8 is emulated on a CPU: slower than bf16, which
only makes the guard's share smaller; the per-layer checks are the same). An all-fp32 policy
asks for nothing but the regions themselves, so its ratio is the rewriting pass's overhead.

Then the lead time on the planted drift (examples/drift.py: GPT-2 2x64, batch 4x64, AdamW
1e-3, one fp16 layer's weight growing 1% per step, aimed at FP16's max at step 300): the step
at which the predictive guard demoted it, the step of its first output beyond FP16's range
(in the run without the predictive check), and the reactive guard's demotion step.

    python benchmarks/bench_guard.py [--rounds 25] [--trainer-steps 4] [--trainer-rounds 8]
                                     [--no-compile] [--no-drift]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
import warnings

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, interleaved, print_table, ratio_cell

import autoprec
from autoprec import Policy
from autoprec.measure.timer import quantile, ratio_interval
from autoprec.runtime.guard import GuardConfig
from examples.data import byte_batches
from examples.gpt2_bytes import make_model

GUARD_POLICY = Policy(default="bf16", layers={
    "transformer.h.*.mlp.c_fc": "fp8",
    "transformer.h.*.attn.c_attn": "fp8",
    "lm_head": "fp32",
})
FP32 = Policy(default="fp32")


def plain_step(model, batch, guard=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if guard is not None:
            guard.step()

    return step


def accelerate_step(accelerator, model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)

    def step():
        loss = model(**batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_run(model, dataset, steps, out_dir, policy=None):
    """A Trainer whose ``train()`` runs ``steps`` steps; returns (train, per-step times): the
    steps are timed from on_step_begin to on_step_end, leaving out the per-run setup."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from autoprec.integrations import PolicyCallback

    step_times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter() - self.t0)

    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=16,
                             learning_rate=1e-4, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    callbacks = [PolicyCallback(policy)] if policy is not None else []
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[*callbacks, StepClock()])
    trainer.remove_callback(PrinterCallback)  # its end-of-run line would clutter the table
    return trainer.train, step_times


class _HookClock:
    """Wall time spent inside the guard's hooks and guard.step(): its own cost, measured
    directly (on a CPU the checks run synchronously, so this includes their kernels), which
    the noise of a shared machine does not blur the way it blurs a ratio of step times."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        from autoprec.runtime.guard import Guard
        from autoprec.runtime.guard.record import Watch

        self._saved = {}
        for cls, names in ((Watch, ("pre_hook", "forward_hook", "grad_hook",
                                       "weight_grad_hook")),
                           (Guard, ("step",))):
            for name in names:
                fn = getattr(cls, name)
                self._saved[(cls, name)] = fn
                setattr(cls, name, self._timed(fn))
        return self

    def _timed(self, fn):
        clock = self

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0

        return timed

    def __exit__(self, *exc):
        for (cls, name), fn in self._saved.items():
            setattr(cls, name, fn)


def row(table, name, anchor, r, anchor_seconds, limit=None):
    """A table row for the ratio ``r`` (an Interval) of ``name`` over ``anchor``."""
    verdict = "" if limit is None else ("ok" if r.value <= limit else
                                        "within noise" if r.low <= limit else "OVER")
    return [table, f"{name} / {anchor}", ratio_cell(r), f"<= {limit}" if limit else "-",
            verdict, f"{anchor_seconds * 1e3:.1f} ms"]


def cmp_row(table, name, anchor, cmp, limit=None):
    return row(table, name, anchor, cmp.ratio(name, anchor), cmp.seconds(anchor), limit)


def compiled_guard_row(base, batch, rounds: int) -> list:
    """The guard's cost under torch.compile (inductor): both models compiled whole (the
    guard's first training forward, which finds the attention cores, runs in the warm-up)."""
    unguarded = autoprec.apply(copy.deepcopy(base), GUARD_POLICY)
    guarded = autoprec.apply(copy.deepcopy(base), GUARD_POLICY, guard=True)
    guard = autoprec.get_guard(guarded)
    steps = {"compiled policy + guard": plain_step(torch.compile(guarded), batch, guard),
             "compiled policy": plain_step(torch.compile(unguarded), batch)}
    times = interleaved(steps, warmup=3, rounds=rounds)
    assert guard.events == [], guard.events
    return cmp_row(f"guard, compiled ({len(guard.watched)} layers)", "compiled policy + guard",
                   "compiled policy", times, 1.03)


def drift_run(predict: bool, steps: int = 400) -> tuple[int | None, int | None]:
    """The planted drift under the guard: (its first demotion's step, the step of the
    drifting layer's first output beyond FP16's range or non-finite; None: none)."""
    from autoprec.integrations import training_kit
    from examples.drift import DRIFT_LAYER, FP16_MAX, drift_policy, plant_drift

    torch.manual_seed(0)
    model = make_model(2, 64, 1, 64)
    batches = byte_batches(8, 4, 64, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plant_drift(model, opt, batches[0], overflow_at=300)
    model, scaler, guard = training_kit(model, drift_policy(), guard=GuardConfig(predict=predict))
    seen = []
    model.get_submodule(DRIFT_LAYER).register_forward_hook(
        lambda m, a, out: seen.append(float(out.detach().abs().max())))
    bad = None
    for s in range(1, steps + 1):
        loss = model(**batches[(s - 1) % len(batches)]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if bad is None and not seen[-1] <= FP16_MAX:
            bad = s
        if guard.step():
            return s, bad
    return None, bad


def guard_rows(base, batch, rounds: int) -> list[list]:
    """The guard (predictive, the default; reactive alone) against no guard, one run."""
    unguarded = autoprec.apply(copy.deepcopy(base), GUARD_POLICY)
    guarded = autoprec.apply(copy.deepcopy(base), GUARD_POLICY, guard=True)
    reactive = autoprec.apply(copy.deepcopy(base), GUARD_POLICY,
                              guard=GuardConfig(predict=False))
    guard, plain_guard = autoprec.get_guard(guarded), autoprec.get_guard(reactive)
    times = interleaved({"policy + guard": plain_step(guarded, batch, guard),
                         "policy + reactive guard": plain_step(reactive, batch, plain_guard),
                         "policy": plain_step(unguarded, batch)},
                        warmup=3, rounds=rounds)
    assert guard.events == [] and plain_guard.events == [], (guard.events, plain_guard.events)
    table = f"guard ({len(guard.watched)} layers)"
    return [cmp_row(table, "policy + guard", "policy", times, 1.03),
            cmp_row(table, "policy + reactive guard", "policy", times, 1.03),
            cmp_row(table, "policy + guard", "policy + reactive guard", times, 1.03)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--trainer-steps", type=int, default=4)
    ap.add_argument("--trainer-rounds", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled guard row")
    ap.add_argument("--no-drift", action="store_true", help="skip the drift's lead time")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*can only emulate.*")
    print(device_line())
    batch = byte_batches(1, 16, 128, seed=0)[0]
    torch.manual_seed(0)
    base = make_model(n_layer=4, n_embd=256, n_head=4, seq_len=128).train()
    rows = []

    # 1. the guard, with nothing to report
    rows += guard_rows(base, batch, args.rounds)
    # the same, measured from inside: time in the guard's hooks and step() per training step
    clocked = autoprec.apply(copy.deepcopy(base), GUARD_POLICY)
    with _HookClock() as clock:
        autoprec.apply(clocked, GUARD_POLICY, guard=True)  # hooks bound to the timed methods
        step = plain_step(clocked, batch, autoprec.get_guard(clocked))
        n = 5
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        total = time.perf_counter() - t0
    share = clock.seconds / total
    rows.append([rows[0][0], "1 + time in guard hooks / step time",
                 f"{1 + share:.3f} ({clock.seconds / n * 1e3:.2f} ms per step)", "<= 1.03",
                 "ok" if share <= 0.03 else "OVER", f"{total / n * 1e3:.1f} ms"])

    if not args.no_compile:
        rows.append(compiled_guard_row(base, batch, args.rounds))

    # 2. apply under each integration: an all-fp32 policy against none
    times = interleaved({"all-fp32 policy": plain_step(autoprec.apply(copy.deepcopy(base), FP32),
                                                       batch),
                         "no policy": plain_step(copy.deepcopy(base), batch)},
                        warmup=3, rounds=args.rounds)
    rows.append(cmp_row("plain loop", "all-fp32 policy", "no policy", times, 1.03))

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="no")
    times = interleaved({
        "all-fp32 policy": accelerate_step(accelerator,
                                           autoprec.apply(copy.deepcopy(base), FP32), batch),
        "no policy": accelerate_step(accelerator, copy.deepcopy(base), batch)},
        warmup=3, rounds=args.rounds)
    rows.append(cmp_row("Accelerate", "all-fp32 policy", "no policy", times, 1.03))

    dataset = [{k: v[i] for k, v in b.items()} for b in [batch] for i in range(16)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"PolicyCallback(all-fp32)": trainer_run(copy.deepcopy(base), dataset,
                                                        args.trainer_steps, tmp, FP32),
                "no callback": trainer_run(copy.deepcopy(base), dataset, args.trainer_steps, tmp)}
        interleaved({name: train for name, (train, _) in runs.items()},
                    warmup=1, rounds=args.trainer_rounds)
    # per-step times inside train() (the warm-up run's steps dropped), paired step by step:
    # the two runs alternate, so step i of one ran next to step i of the other
    times = {name: steps[args.trainer_steps:] for name, (_, steps) in runs.items()}
    a, b = times["PolicyCallback(all-fp32)"], times["no callback"]
    n = min(len(a), len(b))
    rows.append(row("Trainer (per step)", "PolicyCallback(all-fp32)", "no callback",
                    ratio_interval(a[:n], b[:n]), quantile(b[:n]), 1.03))

    print_table(rows, ["setting", "ratio", "value [95% interval]", "target", "", "anchor time"])

    if not args.no_drift:
        predicted, never_bad = drift_run(predict=True)
        reactive, first_bad = drift_run(predict=False)
        print(f"\nplanted drift (examples/drift.py, overflow aimed at step 300): the predictive "
              f"guard demoted at step {predicted} (outputs beyond fp16's range before it: "
              f"{'none' if never_bad is None else f'from step {never_bad}'}); first output "
              f"beyond fp16's range without it at step {first_bad}; the reactive guard "
              f"demoted at step {reactive}: {reactive - predicted} steps earlier, "
              f"{first_bad - predicted} steps before the first overflow."
              if None not in (predicted, reactive, first_bad) else
              f"\nplanted drift: predictive {predicted}, first overflow {first_bad}, "
              f"reactive {reactive} (a run that did not demote)")


if __name__ == "__main__":
    main()
