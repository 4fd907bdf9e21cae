"""Graph breaks under torch.compile: a policy must compile to as many graphs, with as many
breaks, as the model without one.

HF GPT-2 (4 layers, 256 wide, batch 4x128) and HF Llama (2 layers, 64 wide), training forward
and loss, counted with ``torch._dynamo.explain`` (dynamo's tracing only; no kernels are
compiled, so the counts do not depend on the machine), for no policy, all-bf16, bf16 with fp32
layers, and fp8-containing policies on both FP8 engines; each with and without the runtime
guard (``autoprec.apply(..., guard=True)``; counted on the call after its first training
forward, which finds the attention cores and is shown on its own), and with HF activation
checkpointing
(``gradient_checkpointing_enable``, non-reentrant) on both models: regions inside a checkpointed
block carry their format in a TorchFunctionMode, which dynamo traces inside the checkpoint's
higher-order op (a push onto a Python list there was a side effect it refused: up to 7 breaks).

"trainer": the model as transformers builds it, called as HF Trainer's compute_loss calls it
(input_ids, attention_mask, labels, num_items_in_batch). examples/gpt2_bytes.py sets GPT-2's
``loss_type``; transformers 5 finds none in the class name GPT2LMHeadModel, and HF's loss path
then warns once, which dynamo cannot trace: one break in the root's forward, under the root's
region, without a policy too (the anchor row). A policy used to add a graph there (3/2 for 2/1
on the tests' tiny GPT-2; 5/4 to 9/8 checkpointed). Llama's class name gives its loss type.

Compiled step-time ratios against ``torch.autocast`` are benchmarks/bench_apply.py's.

    python benchmarks/bench_compile.py [--no-guard] [--no-checkpointing] [--no-trainer]
        [--trainer-only] [--model gpt2|llama]
"""

from __future__ import annotations

import argparse
import time
import warnings

import _common  # noqa: F401  (sets up sys.path)
import torch
from _common import device_line, print_table

import autoprec
from autoprec import Policy
from examples import gpt2_bytes, llama_bytes
from examples.data import byte_batches

POLICIES = {
    "gpt2": {
        "no policy": None,
        "all-bf16": Policy(default="bf16"),
        "bf16 + fp32 head, h.0.mlp": Policy(default="bf16", layers={
            "transformer.h.0.mlp": "fp32", "lm_head": "fp32"}),
        "bf16 + fp8 mlp/attn + fp32": Policy(default="bf16", layers={
            "transformer.h.*.mlp": "fp8", "transformer.h.1.attn": "fp8:rowwise",
            "transformer.h.0.mlp.c_proj": "fp32", "lm_head": "fp32"}),
        "fp8 default + bf16 + fp32": Policy(default="fp8", layers={
            "transformer.h.1": "bf16", "transformer.h.0.mlp.c_proj": "fp32",
            "lm_head": "fp32"}),
    },
    "llama": {
        "no policy": None,
        "bf16 + fp8 mlp (autoprec) + fp32": Policy(default="bf16", engine="autoprec", layers={
            "model.layers.*.mlp.*": "fp8", "lm_head": "fp32"}),
        "bf16 + fp8 mlp (torchao) + fp32": Policy(default="bf16", engine="torchao", layers={
            "model.layers.*.mlp.*": "fp8", "lm_head": "fp32"}),
    },
}


def make(name: str, trainer: bool = False):
    """The model; ``trainer``: as transformers builds it (GPT-2 without a loss_type)."""
    torch.manual_seed(0)
    if name == "gpt2":
        model = gpt2_bytes.make_model(n_layer=4, n_embd=256, n_head=4, seq_len=128).train()
        if trainer:
            model.loss_type = None
        return model
    return llama_bytes.make_model(2, 64, 128, 4, 2, seq_len=128).train()


def trainer_batch(batch: dict) -> dict:
    """What HF Trainer's compute_loss passes the model."""
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"]),
            "num_items_in_batch": (batch["labels"][:, 1:] != -100).sum()}


def explain(model, batch) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda b: model(**b).loss)(batch)
    return explained.graph_count, explained.graph_break_count


def counts(name: str, policy, *, guard: bool, checkpointing: bool,
           trainer: bool = False) -> tuple[int, int, str, float]:
    """(graphs, breaks, the guard's first call as "graphs/breaks" or "", trace seconds). With
    the guard, its first training forward (which finds the attention cores and changes the
    hooks) is explained on its own, then run eagerly; the counts are those of the next call."""
    model = make(name, trainer)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy is not None:
        autoprec.apply(model, policy, guard=guard)
    batch = byte_batches(1, 4, 128, seed=0)[0]
    if trainer:
        batch = trainer_batch(batch)
    t0 = time.perf_counter()
    first = ""
    if guard:
        first = "/".join(map(str, explain(model, batch)))
        model = make(name, trainer)
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        autoprec.apply(model, policy, guard=True)
        model(**batch).loss.backward()
        autoprec.get_guard(model).step()
    graphs, breaks = explain(model, batch)
    return graphs, breaks, first, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--no-trainer", action="store_true", help="no rows of the Trainer's call")
    ap.add_argument("--trainer-only", action="store_true", help="only the Trainer's call")
    ap.add_argument("--model", choices=sorted(POLICIES), help="one model only")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # fp8 emulated on CPU, HF deprecations: not the subject
    print(device_line())
    # (guard, checkpointing, trainer)
    setups = [(False, False, False)] + ([] if args.no_guard else [(True, False, False)]) + \
        ([] if args.no_checkpointing else [(False, True, False)]) + \
        ([] if args.no_guard or args.no_checkpointing else [(True, True, False)])
    if args.trainer_only:
        setups = []
    if not args.no_trainer:
        setups += [(False, False, True)] + ([] if args.no_checkpointing else [(False, True, True)])
    rows, bases = [], {}
    for name, policies in POLICIES.items():
        if args.model and name != args.model:
            continue
        for guard, ckpt, trainer in setups:
            for label, policy in policies.items():
                if policy is None and guard:
                    continue  # the guard needs a policy; the no-policy row is the anchor
                g, b, first, secs = counts(name, policy, guard=guard, checkpointing=ckpt,
                                           trainer=trainer)
                if policy is None:
                    bases[name, ckpt, trainer] = (g, b)
                base = bases.get((name, ckpt, trainer))
                setup = "+".join(s for s, on in (("guard", guard), ("checkpointing", ckpt),
                                                 ("trainer", trainer)) if on) or "-"
                same = "" if base is None or policy is None else (
                    "same" if (g, b) == base else f"MORE (no policy: {base[0]}/{base[1]})")
                rows.append([name, setup, label, str(g), str(b), same, first or "-",
                             f"{secs:.0f} s"])
                print(*rows[-1], sep="  |  ", flush=True)
    print()
    print_table(rows, ["model", "with", "policy", "graphs", "breaks", "vs no policy",
                       "guard's 1st call", "trace time"])


if __name__ == "__main__":
    main()
