"""Overhead of the rewriting pass: a policy must cost nothing over what it asks for.

HF GPT-2 (4 layers, 256 wide, batch 16x128), training steps (forward, backward, AdamW), all
variants timed round-robin in one run:

    all-fp32 policy  vs  no policy               (target ratio <= 1.03)
    all-bf16 policy  vs  torch.autocast(bf16)    (target ratio <= 1.05)

each ratio with its 95% interval (the tune's own timing protocol, see benchmarks/_common.py)

and the same two pairs under torch.compile (`--no-compile` skips them; compiling takes a few
minutes on 2 cores).

    python benchmarks/bench_apply.py [--rounds 10] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, interleaved, print_table, ratio_cell

import autoprec
from examples.data import byte_batches
from examples.gpt2_bytes import make_model


def step_fn(model, batch, *, autocast=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def variants(compile_: bool, batch):
    torch.manual_seed(0)
    base = make_model(n_layer=4, n_embd=256, n_head=4, seq_len=128).train()
    models = {
        "no policy (fp32)": (copy.deepcopy(base), False),
        "all-fp32 policy": (autoprec.apply(copy.deepcopy(base), autoprec.Policy(default="fp32")),
                            False),
        "torch.autocast(bf16)": (copy.deepcopy(base), True),
        "all-bf16 policy": (autoprec.apply(copy.deepcopy(base), autoprec.Policy(default="bf16")),
                            False),
    }
    fns = {}
    for name, (model, ac) in models.items():
        if compile_:
            model = torch.compile(model)
        fns[name] = step_fn(model, batch, autocast=ac)
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    print(device_line())
    batch = byte_batches(1, 16, 128, seed=0)[0]
    modes = [False] if args.no_compile else [False, True]
    rows = []
    for compile_ in modes:
        times = interleaved(variants(compile_, batch), warmup=3, rounds=args.rounds)
        tag = "compiled" if compile_ else "eager"
        for name, anchor, limit in (("all-fp32 policy", "no policy (fp32)", 1.03),
                                    ("all-bf16 policy", "torch.autocast(bf16)", 1.05)):
            r = times.ratio(name, anchor)
            verdict = "ok" if r.value <= limit else ("within noise" if r.low <= limit
                                                     else "OVER")
            rows.append([tag, f"{name} / {anchor}", ratio_cell(r), f"<= {limit}", verdict,
                         f"{times.seconds(anchor) * 1e3:.1f} ms"])
    print_table(rows, ["mode", "ratio (policy / anchor)", "value [95% interval]", "target", "",
                       "anchor step"])
    print(f"{args.rounds} interleaved rounds; each round keeps the faster of 2 steps per variant")


if __name__ == "__main__":
    main()
