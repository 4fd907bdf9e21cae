"""Peak host memory of a profile and of a tune, against the same model's FP32 AdamW training
step measured the same way, in the same run (issue 38's anchor).

Models: HF Llama-style (LlamaForCausalLM, SwiGLU 2.6875x, 8 heads / 4 KV heads, vocabulary
32,000 so the embedding and head weigh what a real LM's do), ``--sizes HIDDENxLAYERS``.
Calibration: 4 batches of 2x64 random token ids (a profile measures the first 2, a tune holds
the last 2 out). Each measurement runs in a process of its own, 1 thread, with
``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS follows live bytes, and reports the peak RSS
(``ru_maxrss``) above the RSS after every import: so one figure per process, no interference;
and the part's wall seconds (one run: a time, not a ratio with a spread), also divided by
the seconds of one FP32 forward + backward pass of a calibration batch timed afterwards in the
same process (what ``predict_scale.py`` turns into a predicted tune time).

- ``step``: the task's model built, then two FP32 AdamW training steps on one calibration
  batch (the first creates the optimizer's state): what training this model costs;
- ``step-bf16``: the same two steps with an all-bf16 policy applied (``autoprec.apply``, as a
  tune's step timer applies a trial's): what training this model in BF16 costs, the step a
  timed tune's bf16 trials run;
- ``fast`` / ``exact``: ``autoprec.profile(task, target="h100", sensitivity=...)`` with the
  formats fp32, bf16, fp8 (priced by the cost model: no timing, only the numerics);
- ``exact-spilled``: the exact profile with ``reference_gradients="spilled"``: the FP32
  reference's gradients of both calibration batches kept in a temporary file, each read back
  as a comparison's gradient of the same parameter arrives (``exact`` keeps them in memory
  wherever they take under a quarter of the free memory, as here);
- ``step@2`` / ``fast@2`` / ``exact@2`` / ``exact-spilled@2`` / ``tune@2`` / ``tune-lean@2``:
  the same under
  ``torchrun`` on 2 gloo ranks, the model
  built on the meta device and sharded by FSDP2 (the embedding, each block, the head, the
  root) before it gets memory; the figure is the rank with the highest peak;
- ``tune``: ``autoprec.tune(task, target="h100", sensitivity="fast", n_trials=4)``, the
  held-out batches' FP32 gradients kept through the search (``holdout_gradients="kept"``);
- ``tune-lean``: the same tune with ``holdout_gradients="recomputed"``: each trial computes
  each held-out batch's reference gradients again beside its own (what ``"auto"`` picks when
  keeping them would take over a quarter of the free memory);
- ``tune-spilled`` / ``tune-spilled@2``: the same with ``holdout_gradients="spilled"``: the
  held-out batches' FP32 gradients computed once and kept in a temporary file (on disk, so
  not in RSS: the page cache may hold them, and gives them up under pressure), each read back
  as a trial's gradient of the same parameter arrives;
- ``tune-timed``: the tune the README's main job runs, its steps timed here (no ``target``):
  the step timer trains the same model with an AdamW at learning rate 0 (formats fp32 and
  bf16, 2 trials, a short re-timing: the memory, not the verdict, is what is read);
- ``tune-timed-lean``: the same with ``holdout_gradients="recomputed"``;
- ``step-ac`` / ``fast-ac`` / ``exact-ac``: ``step``, ``fast`` and ``exact`` on the same model
  trained with activation checkpointing (HF's ``gradient_checkpointing_enable``,
  non-reentrant: each decoder block's activations computed again in the backward), with the
  ``step`` of the model without it as the anchor as everywhere. Checkpointing matters where
  activations do: ``--seq`` sets the calibration's sequence length (64 by default).

Each figure is printed in bytes, as a multiple of P (the model's FP32 parameter bytes) and as
a multiple of ``step``. One process per figure: its spread is the allocator's, a few MB;
rerun to see it.

    python benchmarks/bench_profile_memory.py [--sizes 512x4 512x8 1024x4]
                                              [--parts step fast exact tune] [--seq 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 32_000


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _config(hidden: int, layers: int, seq: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden,
                       intermediate_size=hidden * 43 // 16, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=seq, tie_word_embeddings=False,
                       attn_implementation="eager", use_cache=False)


def _task(hidden: int, layers: int, device: str = "cpu", seq: int = 64,
          checkpointed: bool = False):
    """The Llama every figure measures; built directly on ``device`` (a 3B model initialised
    on a GPU takes a second, on its host's CPU a minute), its blocks checkpointed if
    ``checkpointed``."""
    import torch
    from transformers import LlamaForCausalLM

    import autoprec

    def build():
        with torch.device(device):
            model = LlamaForCausalLM(_config(hidden, layers, seq))
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    return autoprec.Task(model=build, batches=batches, name=f"llama-{hidden}x{layers}",
                         device=device)


def child(part: str, size: str, seq: int = 64) -> None:
    """One measurement (see the module docstring); prints one JSON line."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline, as every part needs it)

    import autoprec
    from autoprec.tuning import tune

    torch.set_num_threads(1)
    hidden, layers = (int(x) for x in size.split("x"))
    checkpointed = part.endswith("-ac")
    part = part.removesuffix("-ac")
    task = _task(hidden, layers, seq=seq, checkpointed=checkpointed)
    if part.endswith("@2"):
        import torch.distributed as dist

        import examples.tune_sharded  # noqa: F401  (the sharded build: imported before the baseline)

        dist.init_process_group("gloo")
    base = _rss()
    start = time.perf_counter()
    if part in ("step", "step@2", "step-bf16"):
        model = _sharded(hidden, layers) if part == "step@2" else task.build_model()
        if part == "step-bf16":
            autoprec.apply(model, autoprec.Policy(default=autoprec.Format.BF16), strict=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            task.loss(model, task.batches[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        params = sum(p.numel() * p.element_size() for p in model.parameters()) \
            if part == "step" else None
    elif part.split("@")[0] in ("fast", "exact", "exact-spilled"):
        mode, _, ways = part.split("@")[0].partition("-")
        sharded = {"model": _sharded(hidden, layers)} if part.endswith("@2") else {}
        prof = autoprec.profile(task, ("fp32", "bf16", "fp8"), target="h100",
                                sensitivity=mode, n_batches=2, progress=False,
                                reference_gradients=ways or "auto", **sharded)
        assert prof.layers
        params = None
    elif part in ("tune-timed", "tune-timed-lean"):
        from autoprec.tuning.config import TimingConfig

        lean = {"holdout_gradients": "recomputed"} if part.endswith("lean") else {}
        with tempfile.TemporaryDirectory() as tmp:
            tune(task, formats=("fp32", "bf16"), sensitivity="fast", n_trials=2,
                 progress=False, output=os.path.join(tmp, "p.yaml"),
                 timing=TimingConfig(final_rounds=3, max_final_rounds=3, trial_rounds=2), **lean)
        params = None
    elif part in ("tune", "tune-lean", "tune-spilled", "tune@2", "tune-lean@2",
                  "tune-spilled@2"):
        sharded = {"model": _sharded(hidden, layers)} if part.endswith("@2") else {}
        holdout = "recomputed" if "lean" in part else "spilled" if "spilled" in part else "kept"
        with tempfile.TemporaryDirectory() as tmp:
            tune(task, target="h100", sensitivity="fast", n_trials=4, progress=False,
                 output=os.path.join(tmp, "p.yaml"), holdout_gradients=holdout, **sharded)
        params = None
    else:
        raise SystemExit(f"unknown part {part!r}")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"part": part, "size": size, "peak": peak, "params": params,
                      "seconds": seconds, "pass": _pass_seconds(task)}))


def _sharded(hidden: int, layers: int):
    """The Llama built on the meta device, sharded by FSDP2 over the ranks torchrun started (the
    embedding, each block, the head, then the root: torchtitan's units), and only then given
    memory (its own shard on each rank) and initialised: no rank ever holds the whole model
    (``examples/tune_sharded.py``'s build)."""
    from examples.tune_sharded import build_sharded

    return build_sharded(_config(hidden, layers))


def _pass_seconds(task) -> float:
    """The median of three timed FP32 forward + backward passes of one calibration batch (after
    one untimed), on a model built after the part's peak was read: the unit the part's wall
    seconds are divided by, measured in the same process, so a burst of load on the machine
    moves both."""
    import statistics

    model = task.build_model()
    times = []
    for _ in range(4):
        t = time.perf_counter()
        task.loss(model, task.batches[0]).backward()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def measure(part: str, size: str, seq: int = 64) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    from _common import free_port

    n = int(part.split("@")[1]) if "@" in part else 1  # ranks
    ranks = ["-m", "torch.distributed.run", "--nproc-per-node", str(n),
             "--master-port", str(free_port())] if n > 1 else []
    out = subprocess.run([sys.executable, *ranks, __file__, "--child", part, size,
                          "--seq", str(seq)], env=env,
                         capture_output=True, text=True, check=False)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or len(lines) != n:
        raise SystemExit(f"{part} {size} failed:\n{out.stderr[-3000:]}")
    return max(lines, key=lambda r: r["peak"])  # the rank with the highest peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["512x4", "512x8", "1024x4"])
    ap.add_argument("--parts", nargs="+", default=["step", "fast", "exact", "tune"],
                    choices=["step", "step-bf16", "fast", "exact", "exact-spilled", "tune",
                             "tune-lean", "tune-spilled", "tune-timed", "tune-timed-lean",
                             "step@2", "fast@2", "exact@2", "exact-spilled@2", "tune@2",
                             "tune-lean@2", "tune-spilled@2", "step-ac", "fast-ac",
                             "exact-ac"])
    ap.add_argument("--seq", type=int, default=64,
                    help="the calibration batches' sequence length (2 sequences each)")
    ap.add_argument("--child", nargs=2, metavar=("PART", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, seq=args.seq)
        return
    sys.path.insert(0, HERE)
    from _common import device_line

    print(device_line().replace("threads 2", "threads 1 per measurement"), flush=True)
    print(f"calibration: batches of 2 x {args.seq} tokens", flush=True)
    parts = ["step", *[p for p in args.parts if p != "step"]]
    print("| model | P (fp32 params) | " + " | ".join(f"{p} (x P, x step)" for p in parts)
          + " |\n|" + "---|" * (len(parts) + 2), flush=True)
    seconds = []
    for size in args.sizes:
        got = {p: measure(p, size, args.seq) for p in parts}
        P, step = got["step"]["params"], got["step"]["peak"]
        cells = [f"{got[p]['peak'] / 2**20:.0f} MiB ({got[p]['peak'] / P:.2f} P, "
                 f"{got[p]['peak'] / step:.2f}x)" for p in parts]
        print(f"| {size} | {P / 2**20:.0f} MiB | " + " | ".join(cells) + " |", flush=True)
        seconds.append(f"{size}: " + ", ".join(
            f"{p} {got[p]['seconds']:.1f} s = {got[p]['seconds'] / got[p]['pass']:.0f} passes"
            for p in parts))
    print("\nwall seconds, one run each, and as FP32 forward + backward passes of one "
          "calibration batch timed in the same process:\n" + "\n".join(seconds), flush=True)


if __name__ == "__main__":
    main()
