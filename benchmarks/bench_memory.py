"""Predicted vs measured peak training-step memory, per policy.

The predictor (autoprec.memory.MemoryModel: the measured all-fp32 and all-bf16 steps plus
per-layer changes from the captured shapes) against a measurement of the same step: on CUDA
the allocator's ``max_memory_allocated``, elsewhere the peak of a ``torch.profiler`` memory
trace. Models: the README's GPT-2 task (examples/gpt2_bytes.py:task, 4 x 256, batch 16 x 128)
and a Llama with examples/llama_bytes.py's architecture at a width this machine trains
(``--llama-hidden``; the 8B widths need a GPU's memory). Memory, not time: no interleaving.
The measured column is always the step on autocast's own 16-bit kernels; the predictor
calibrates as a tune does (by FP32 emulation of the 16-bit GEMMs where the host has no units
for them, autoprec.host.slow_16bit_dtypes).

Then the emulation's bytes against the kernels' (``--emulation-widths``): the same Llama's
step under 16-bit policies, traced once on autocast's kernels and once with their GEMMs
emulated in FP32 (runtime.fp8.emulating, which saves the 16-bit copies autocast saves), as
emulated / native. Each step is traced twice: a trace is deterministic, and the two must agree.

Then (``--calibration-rounds N``, 0 skips it) what pricing the optimizer costs in time: the
memory model's fp32 measurement on the README's GPT-2 task with the optimizer's phase priced a
part of the parameters at a time (``priced_optimizer=True``, what a tune runs) against the
same measurement holding the whole optimizer (what it ran before), timed in interleaved rounds:
priced / held, with its interval.

    python benchmarks/bench_memory.py [--llama-hidden 256] [--skip-llama]
                                      [--emulation-widths 256 512] [--calibration-rounds 8]
"""

from __future__ import annotations

import argparse
import copy
import warnings

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, interleaved, print_table, ratio_cell

import autoprec
from autoprec.measure.deviation import prepare_for_measurement
from autoprec.memory import format_size, measure_step_memory, memory_model
from autoprec.policy import Policy
from autoprec.task import default_loss
from examples import gpt2_bytes, llama_bytes
from examples.data import byte_batches

POLICIES = {
    "gpt2": {"fp32": Policy(default="fp32"), "bf16": Policy(default="bf16"),
             "fp8 tensorwise": Policy(default="fp8"),
             "fp8 rowwise": Policy(default="fp8:rowwise"),
             "bf16, head fp32": Policy(default="bf16", layers={"lm_head": "fp32"}),
             "mlp fp8, rest fp32": Policy(default="fp32",
                                          layers={"transformer.h.*.mlp.*": "fp8"})},
    "llama": {"fp32": Policy(default="fp32"), "bf16": Policy(default="bf16"),
              "fp8 tensorwise": Policy(default="fp8"),
              "fp8 rowwise_with_gw_hp": Policy(default="fp8:rowwise_with_gw_hp"),
              "mlp fp8, rest bf16": Policy(default="bf16",
                                           layers={"model.layers.*.mlp.*": "fp8"}),
              "attention fp32, rest bf16": Policy(default="bf16",
                                                  layers={"model.layers.*.self_attn": "fp32"})},
}


def llama_task(hidden: int) -> autoprec.Task:
    return autoprec.Task(
        model=lambda: llama_bytes.make_model(2, hidden, hidden * 7 // 2, max(1, hidden // 64),
                                             max(1, hidden // 256), seq_len=128),
        batches=byte_batches(2, 8, 128, seed=1), name=f"llama-2x{hidden}-bytes")


def step_peak(task: autoprec.Task, model: torch.nn.Module, policy: Policy,
              emulate: bool) -> int:
    """The traced peak of one training step of a copy of ``model`` on the task's first batch,
    its 16-bit GEMMs on autocast's kernels or ``emulate``d in FP32."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*can only emulate.*")
        return measure_step_memory(copy.deepcopy(model), task.example_batch(), policy,
                                   task.loss_fn or default_loss, task.make_optimizer,
                                   emulate=emulate).peak


def rows_for(task: autoprec.Task, policies: dict[str, Policy]) -> list[list[str]]:
    mm = memory_model(task)
    model = prepare_for_measurement(task.build_model())
    rows = []
    for name, policy in policies.items():
        measured = step_peak(task, model, policy, emulate=False)
        predicted = mm.predict(policy)
        rows.append([task.name, name, format_size(predicted), format_size(measured),
                     f"{predicted / measured:.3f}",
                     "(calibration)" if name in ("fp32", "bf16") else ""])
        print(f"  {task.name} {name}: {predicted / measured:.3f}", flush=True)
    return rows


EMULATED = {"bf16": Policy(default="bf16"), "fp16": Policy(default="fp16"),
            "mlp fp8, rest bf16": Policy(default="bf16", layers={"model.layers.*.mlp.*": "fp8"}),
            "attention fp32, rest bf16": Policy(default="bf16",
                                                layers={"model.layers.*.self_attn": "fp32"})}


def emulation_rows(hidden: int) -> list[list[str]]:
    """Per 16-bit policy: the traced step on autocast's kernels and under FP32 emulation."""
    task = llama_task(hidden)
    model = prepare_for_measurement(task.build_model())
    rows = []
    for name, policy in EMULATED.items():
        peaks = {}
        for emulate in (False, True):
            traces = [step_peak(task, model, policy, emulate) for _ in range(2)]
            if traces[0] != traces[1]:
                raise SystemExit(f"{task.name} {name}: two traces of one step differ "
                                 f"({traces}): the measurement is not deterministic here")
            peaks[emulate] = traces[0]
        rows.append([task.name, name, format_size(peaks[False]), format_size(peaks[True]),
                     f"{peaks[True] / peaks[False]:.3f}"])
        print(f"  {task.name} {name}: emulated / native {peaks[True] / peaks[False]:.3f}",
              flush=True)
    return rows


def calibration_time(rounds: int) -> str:
    """The fp32 calibration step measured with the optimizer priced / held, interleaved."""
    task = gpt2_bytes.task()
    model = prepare_for_measurement(task.build_model())
    batch, loss = task.example_batch(), task.loss_fn or default_loss
    fp32 = Policy(default="fp32")

    def run(priced: bool):
        return lambda: measure_step_memory(model, batch, fp32, loss, task.make_optimizer,
                                           priced_optimizer=priced)
    cmp = interleaved({"held": run(False), "priced": run(True)}, warmup=1, rounds=rounds,
                      repeats=1)
    return f"{task.name}: priced / held {ratio_cell(cmp.ratio('priced', 'held'))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-hidden", type=int, default=256)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--emulation-widths", type=int, nargs="*", default=[256, 512],
                    help="Llama widths for the emulated-vs-native table (none: skip it)")
    ap.add_argument("--calibration-rounds", type=int, default=8,
                    help="interleaved rounds timing the priced calibration (0: skip it)")
    args = ap.parse_args()
    print(device_line())
    rows = rows_for(gpt2_bytes.task(), POLICIES["gpt2"])
    if not args.skip_llama:
        rows += rows_for(llama_task(args.llama_hidden), POLICIES["llama"])
    print_table(rows, ["task", "policy", "predicted peak", "measured peak", "ratio", ""])
    worst = max(abs(float(r[4]) - 1) for r in rows)
    print(f"largest error: {worst:.1%} (measured: "
          f"{'max_memory_allocated' if torch.cuda.is_available() else 'torch.profiler trace'} "
          "of the step on autocast's kernels)")
    if args.emulation_widths:
        print("\nthe step's peak with its 16-bit GEMMs emulated in FP32, against autocast's kernels:")
        rows = [r for w in args.emulation_widths for r in emulation_rows(w)]
        print_table(rows, ["task", "policy", "native peak", "emulated peak", "emulated / native"])
        spread = [float(r[4]) for r in rows]
        print(f"emulated / native: {min(spread):.3f} to {max(spread):.3f}")
    if args.calibration_rounds:
        print("\nthe fp32 calibration step's time, the optimizer priced a part at a time / held:")
        print(calibration_time(args.calibration_rounds))


if __name__ == "__main__":
    main()
