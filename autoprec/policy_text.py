"""What ``autoprec show`` and ``autoprec diff`` print about policies: the lines, built from
policies and a profile already read and checked (:mod:`autoprec.cli` reads the files and
prints). Every text that came from a file is escaped and bounded (:func:`~autoprec._util.shown`)."""

from __future__ import annotations

import dataclasses
import math

from autoprec import profile_view
from autoprec._util import shown

__all__ = ["show_lines", "diff_lines"]


def show_lines(policy, source: str, prof, prof_path: str) -> list[str]:
    """``show``'s lines for ``policy`` (read from ``source``): its entries, settings, phases,
    provenance and certificate, then each layer's reason from ``prof`` (read from
    ``prof_path``; None: a line that says the profile is missing)."""
    lines = [f"policy {shown(source)}"]
    if policy.model_name:
        lines.append(f"  model: {shown(policy.model_name)}  fingerprint "
                     f"{shown(policy.fingerprint or '-')}")
    lines.append(f"  default: {policy.default.label}")
    lines += [f"  {shown(pattern, 512)}: {fmt.label}" for pattern, fmt in policy.layers.items()]
    if any(f.is_scaled for f in policy.formats_used()):
        lines.append(f"  fp8: default recipe {shown(policy.fp8_recipe)}; scaled formats' "
                     f"engine {shown(policy.engine)}")
    lines += _phase_lines(policy, prof)
    if policy.tuned:
        lines += ["provenance:", _provenance_text(policy.provenance)]
    lines += _certificate_lines(policy)
    if prof is not None:
        lines.append(_layer_reasons(policy, prof, prof_path))
    else:
        lines.append(f"\n(no profile at {shown(prof_path)}: per-layer reasons need the profile "
                     "`tune` writes)")
    return lines


def diff_lines(a, b, prof) -> tuple[list[str], bool]:
    """``diff``'s lines from policy ``a`` to ``b`` (each layer of ``prof`` resolved in both,
    when there is a profile), and whether they differ in what training computes (the
    provenance and certificate lines are shown but do not count)."""
    lines = _setting_changes(a, b) + _phase_changes(a, b)
    if a.default != b.default:
        lines.append(f"default: {a.default.label} -> {b.default.label}")
    for pattern in dict.fromkeys([*a.layers, *b.layers]):
        fa, fb = a.layers.get(pattern), b.layers.get(pattern)
        if fa != fb:
            lines.append(f"{shown(pattern, 512)}: "
                         f"{fa.label if fa else '(default ' + a.default.label + ')'}"
                         f" -> {fb.label if fb else '(default ' + b.default.label + ')'}")
    differ = bool(lines)
    if prof is not None:
        changed = [(lp.fqn, a.format_for(lp.fqn), b.format_for(lp.fqn)) for lp in prof.layers
                   if a.format_for(lp.fqn) is not b.format_for(lp.fqn)]
        differ = differ or bool(changed)
        lines.append(f"resolved per layer ({len(changed)} of {len(prof.layers)} differ):")
        lines += [f"  {shown(f, 200)}: {x.label} -> {y.label}" for f, x, y in changed]
    if not differ:
        lines.insert(0, "the two policies are the same" + (
            " (only their provenance, `tuned:`, differs)" if a.tuned != b.tuned else ""))
    # provenance, not what training computes: shown, but the exit status is about the latter
    lines += _certificate_changes(a, b)
    return lines, differ


def _certificate_lines(policy) -> list[str]:
    """`show`'s lines for the certificate: its verdict, and whether it still covers the policy
    (an edit after certification changes the policy's digest)."""
    cert, covers = policy.certified()
    if cert is None:
        return ["certificate: none (`autoprec validate POLICY --task T -o OUT` certifies it)"]
    lines = [f"certificate: {cert.describe()}"]
    if not covers:
        lines.append(f"  NOT CERTIFIED as it is: the certificate is of {shown(cert.digest[:19])}"
                     f"..., this policy is {policy.digest()[:19]}...: it was edited after "
                     "certification; run `autoprec validate` again")
    return lines


def _num(value, spec: str) -> str:
    """``value`` formatted with ``spec`` when it is a number; else as written (a hand-edited or
    foreign provenance is shown, never a crash)."""
    if _is_number(value):
        return format(value, spec)
    return "?" if value is None else shown(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _run_interval(ends) -> str:
    if isinstance(ends, (list, tuple)) and len(ends) == 2:
        return (f"; this run's 95% interval of the ratio {_num(ends[0], '.2f')}-"
                f"{_num(ends[1], '.2f')}x")
    return ""


def _provenance_text(prov) -> str:
    lines = []
    for key in ("device", "torch", "task"):
        if getattr(prov, key):
            lines.append(f"  {key}: {shown(getattr(prov, key), 200)}")
    if prov.budget is not None:
        grad, bias = prov.budget.max_grad_error, prov.budget.max_grad_bias
        lines.append(f"  budget: loss change <= {_num(prov.budget.max_loss_increase, '.2%')}, "
                     f"gradient error <= {'-' if grad is None else _num(grad, 'g')}"
                     + ("" if bias is None else f", gradient bias <= {_num(bias, 'g')}"))
    if prov.speedup is not None:
        rounds = (f" ({prov.speedup.rounds} timing rounds; 95% of re-timings as long land in "
                  "the interval)" if prov.speedup.rounds else "")
        lines.append(f"  speed-up vs fp32: {shown(prov.speedup)}{rounds}")
        if (prov.device or "").startswith("cost model:"):
            from autoprec.pricing import calibration_line

            target = prov.device[len("cost model:"):].split("(")[0].strip()
            lines.append(f"  {calibration_line(target)}")
    if prov.loss_increase is not None:
        lines.append(f"  loss change vs fp32: {_num(prov.loss_increase, '+.3%')}; gradient "
                     f"error {_num(prov.grad_error, '.3g')}")
    for note in prov.verdict:
        lines.append(f"  verdict: {shown(note, 1000)}")
    extra = dict(prov.extra)
    study = extra.pop("study", None)
    if isinstance(study, dict):
        lines.append(f"  study: {shown(study.get('name'))} ({_num(study.get('trials'), 'd')} "
                     f"trials, {_num(study.get('distinct'), 'd')} distinct policies)")
    elif study is not None:
        lines.append(f"  study: {shown(study)}")
    memory = extra.pop("memory", None)
    if isinstance(memory, dict) and memory.get("predicted_peak_bytes") is not None:
        from autoprec.memory import format_size

        peak = memory["predicted_peak_bytes"]
        lines.append("  peak training memory (predicted, one step on the calibration batch): "
                     + (format_size(peak) if _is_number(peak) and math.isfinite(peak)
                        else shown(peak)))
    elif memory is not None:
        lines.append(f"  memory: {shown(memory)}")
    lines += _bias_lines(extra.pop("bias", None))
    timing = extra.pop("timing", None)
    if isinstance(timing, dict):
        drift = timing.get("fp32_drift")
        if isinstance(drift, (list, tuple)) and len(drift) == 2:
            drift = f"{_num(drift[0], '.2f')}-{_num(drift[1], '.2f')}x"
        lines.append(f"  timing: {_num(timing.get('rounds'), 'g')} rounds; fp32 against itself "
                     f"within {_num(timing.get('aa_noise'), '.1%')}"
                     + (f"; fp32 steps during the search {drift}" if drift else "")
                     + _run_interval(timing.get("run_interval"))
                     + ("; too noisy to decide" if timing.get("too_noisy") else ""))
    elif timing is not None:
        lines.append(f"  timing: {shown(timing)}")
    for key, value in extra.items():
        lines.append(f"  {shown(key)}: {shown(value)}")
    return "\n".join(lines)


def _bias_lines(bias) -> list[str]:
    """The winner's gradient bias and where the tune measured it (``tuned.bias``)."""
    if not isinstance(bias, dict):
        return [] if bias is None else [f"  bias: {shown(bias)}"]
    where = (f"step {_num(bias.get('step'), 'd')} of a {_num(bias.get('run_steps'), 'd')}-"
             "step bf16 reference run" if bias.get("run_steps") else "the untrained model")
    return [f"  gradient bias vs fp32: {_num(bias.get('grad_bias'), '.3g')} on "
            f"{_num(bias.get('batches'), 'd')} held-out batches, measured at {where}"]


def _layer_reasons(policy, prof, prof_path: str) -> str:
    from autoprec._util import text_table
    from autoprec.policy import DEFAULT_MAX_LOSS_INCREASE
    from autoprec.pricing import CostSource

    budget = policy.provenance.budget
    limit = budget.max_loss_increase if budget is not None else DEFAULT_MAX_LOSS_INCREASE
    rows = []
    mix: dict[str, float] = {}
    for lp in prof.layers:
        fmt = policy.format_for(lp.fqn)
        why = profile_view.fp8_reason(prof, lp.fqn, fmt, max_loss_change=limit)
        rows.append((shown(lp.fqn, 200), shown(lp.layer.kind), fmt.label,
                     f"{lp.layer.flops / 1e9:.3f}", shown(why, 400), _sources(lp)))
        mix[fmt.label] = mix.get(fmt.label, 0.0) + lp.layer.flops
    total = max(sum(mix.values()), 1)
    where = f"cost model {shown(prof.target)}" if prof.target else \
        f"measured on {shown(prof.device)}"
    shares = ", ".join(f"{name} {flops / total:.1%}" for name, flops in
                       sorted(mix.items(), key=lambda kv: -kv[1]))
    return (f"\nper layer (profile {shown(prof_path)}, {where}):\n"
            + text_table(("layer", "kind", "format", "GFLOP", "why not fp8 / why this recipe",
                          "sensitivity"), rows, indent="  ", rule=False)
            + "\n  (recipes: speed vs bf16 as profiled, loss change with the layer alone in it;"
            + "\n  sensitivity: est = first-order estimate, meas = measured exactly)"
            + f"\n  {shown(profile_view.sensitivity_summary(prof), 1000)}"
            + f"\n\nmatmul FLOPs by format: {shares}"
            + (f"\n{CostSource.of(prof.target).calibration()}" if prof.target else ""))


def _sources(lp) -> str:
    """Which of a layer's numbers were estimated and which measured, and why measured."""
    parts = []
    for fmt, err in lp.sensitivity.items():
        why = lp.exact_why.get(fmt)
        parts.append(f"{fmt.label} {'est' if err.source == 'estimated' else 'meas'}"
                     + (f" ({shown(why)})" if why else ""))
    return ", ".join(parts) or "-"


def _phase_text(phase) -> str:
    """One phase's changes, e.g. ``fp8 -> bf16; lm_head: fp32; default fp32``."""
    parts = [f"{shown(k)} -> {v.label}" for k, v in phase.formats.items()]
    parts += [f"{shown(p, 512)}: {f.label}" for p, f in phase.layers.items()]
    if phase.default is not None:
        parts.append(f"default {phase.default.label}")
    return "; ".join(parts)


def _phase_lines(policy, prof) -> list[str]:
    """`show`'s lines for the phases: where each starts, what it changes, and (with a
    profile) how many of the profiled layers compute in another format than in the first."""
    if not policy.phases:
        return []
    lines = [f"phases ({len(policy.phases) + 1}; the training integrations switch at the step):",
             "  phase 0, from step 0: the formats above"]
    for i, phase in enumerate(policy.phases, start=1):
        line = f"  phase {i}, {shown(phase.describe(), 200)}: {_phase_text(phase)}"
        if prof is not None:
            p = policy.phase(i)
            moved = sum(p.format_for(lp.fqn) is not policy.format_for(lp.fqn) for lp in prof.layers)
            line += f" ({moved} of {len(prof.layers)} profiled layers change)"
        lines.append(line)
    return lines


def _phase_changes(a, b) -> list[str]:
    """`diff`'s lines for the phases, phase by phase."""
    lines = []
    for i in range(max(len(a.phases), len(b.phases))):
        pa = a.phases[i] if i < len(a.phases) else None
        pb = b.phases[i] if i < len(b.phases) else None
        if pa == pb:
            continue
        def described(p):
            return "(none)" if p is None else f"[{shown(p.describe(), 200)}: {_phase_text(p)}]"
        lines.append(f"phase {i + 1}: {described(pa)} -> {described(pb)}")
    return lines


def _certificate_changes(a, b) -> list[str]:
    """`diff`'s line for the certificates, when they differ (or one policy has none)."""
    def said(policy) -> str:
        cert, covers = policy.certified()
        if cert is None:
            return "(none)"
        return cert.describe() + ("" if covers else " [edited since]")

    before, after = said(a), said(b)  # the same record can cover one and not the other
    return [] if before == after else [f"certificate: {before} -> {after}"]


def _setting_changes(a, b) -> list[str]:
    """What differs between two policies besides their layers' formats, of all that changes
    what training computes (or what the policy is checked against): the model it was made for,
    the fp8 recipe and engine, the loss scaling."""
    def setting(value) -> str:
        return "-" if value is None else shown(value)

    lines = []
    for label, x, y in (("model", a.model_name, b.model_name),
                        ("model fingerprint", a.fingerprint, b.fingerprint),
                        ("fp8 recipe", a.fp8_recipe, b.fp8_recipe),
                        ("scaled engine", a.engine, b.engine)):
        if x != y:
            lines.append(f"{label}: {setting(x)} -> {setting(y)}")
    sa, sb = a.loss_scaling, b.loss_scaling
    for f in dataclasses.fields(sa):
        if getattr(sa, f.name) != getattr(sb, f.name):
            lines.append(f"loss_scaling.{f.name}: {shown(getattr(sa, f.name))} -> "
                         f"{shown(getattr(sb, f.name))}")
    return lines
