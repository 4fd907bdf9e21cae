"""Whether a change moved the profile's numbers: every layer x format's loss change, whole-model
gradient error, own gradient error and output SQNR, in the first-order ("fast") and the
measured ("exact") modes, on the four example models of ``bench_estimate.py``, computed by this
checkout and by another revision in the same run; and the policy each tunes for an H100
(priced: deterministic, so any difference is the numbers').

Each side runs in a process of its own whose ``autoprec`` is that checkout's (the other one a
``git worktree`` of ``--against``, removed after). Per model x mode x metric it prints how many
values are bitwise equal, the largest relative difference, and the Spearman rank correlation
of the two sides (issue 38: equal to float rounding, or Spearman >= 0.99 where a summation
order changed); then whether the tuned policies are the same.

    python benchmarks/bench_same_numbers.py [--against REV] [--only NAME] [--skip-tune]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIELDS = ("loss_rel_change", "grad_rel_error", "layer_grad_rel_error", "output_sqnr_db")


def child(root: str, out: str, only: str | None, skip_tune: bool) -> None:
    """Measure with the ``autoprec`` of ``root``; write the numbers as JSON to ``out``."""
    sys.path.insert(0, root)
    import warnings

    import torch

    # this side's autoprec and examples first: bench_estimate's _common puts this checkout's
    # root on the path, which must not shadow them
    import autoprec  # noqa: F401
    import examples  # noqa: F401
    from autoprec.measure.sensitivity import measure_sensitivity
    from autoprec.tuning import tune

    sys.path.insert(1, HERE)
    import bench_estimate as B

    for mod in (autoprec, examples):
        assert mod.__file__.startswith(os.path.join(root, "")), mod.__file__

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    result: dict = {}
    for name, task, fmts in B.cases():
        if only and only not in name:
            continue
        layers = B.layers_of(task)
        entry = result[name] = {}
        for mode in ("fast", "exact"):
            sens = measure_sensitivity(task, layers, fmts, mode=mode)
            entry[mode] = {f"{layer}|{fmt}": [getattr(s, f) for f in FIELDS]
                           for layer, row in sens.items() for fmt, s in row.items()}
        if not skip_tune:
            with tempfile.TemporaryDirectory() as tmp:
                policy = tune(task, target="h100", n_trials=12, progress=False,
                              output=os.path.join(tmp, "p.yaml")).policy
            entry["policy"] = {"default": str(policy.default),
                               "layers": {k: str(v) for k, v in policy.layers.items()}}
    with open(out, "w") as f:
        json.dump(result, f)


def run_side(root: str, only: str | None, skip_tune: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONPATH=root)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", root, out]
    cmd += ["--only", only] if only else []
    cmd += ["--skip-tune"] if skip_tune else []
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the side at {root} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan
    return float(spearmanr(xs, ys)[0])


def compare(new: dict, old: dict) -> list[list[str]]:
    rows = []
    for name in new:
        for mode in ("fast", "exact"):
            a, b = new[name][mode], old[name][mode]
            keys = sorted(set(a) & set(b))
            for k, field in enumerate(FIELDS):
                pairs = [(a[key][k], b[key][k]) for key in keys
                         if a[key][k] is not None and b[key][k] is not None
                         and math.isfinite(a[key][k]) and math.isfinite(b[key][k])]
                equal = sum(x == y for x, y in pairs)
                rel = max((abs(x - y) / max(abs(y), 1e-30) for x, y in pairs), default=0.0)
                rows.append([name, mode, field, f"{equal}/{len(pairs)}", f"{rel:.1e}",
                             f"{spearman([x for x, _ in pairs], [y for _, y in pairs]):.4f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="the revision to compare with")
    ap.add_argument("--only", help="only the model whose name contains this")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.only, args.skip_tune)
        return
    sys.path.insert(0, HERE)
    from _common import device_line, print_table, worktree

    print(device_line())
    with worktree(args.against) as other:
        new = run_side(ROOT, args.only, args.skip_tune)
        old = run_side(other, args.only, args.skip_tune)
    print(f"this checkout against {args.against}: each layer x format's numbers")
    print_table(compare(new, old),
                ["model", "mode", "metric", "bitwise equal", "max rel diff", "Spearman"])
    for name in new:
        if "policy" in new[name]:
            same = new[name]["policy"] == old[name].get("policy")
            print(f"{name}: tuned policy {'the same' if same else 'DIFFERS'}")
            if not same:
                print(f"  this: {new[name]['policy']}\n  {args.against}: {old[name].get('policy')}")


if __name__ == "__main__":
    main()
