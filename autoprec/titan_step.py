"""torchtitan's training step priced whole: its seconds (:func:`price_training_step`) and its
peak memory per GPU (:func:`price_training_memory`), for a Llama-style decoder trained as
torchtitan runs it (:class:`TrainingSetup`; ``LLAMA3_8B``), on a device of the cost model with
what a step needs beyond its GEMMs and copies (:class:`StepSpec`, ``STEP_SPECS``).

The cost model (:mod:`autoprec.costmodel`) prices layers, which is what a tune compares. A
training step also spends time the formats barely change (attention's softmax-matmul kernel,
norms and elementwise ops, the loss, the optimizer, FSDP's collectives), which dilutes a
layer's speed-up. To check the cost model against published measurements of whole steps
(:mod:`autoprec.calibration`), :func:`price_training_step` prices the blocks' linears with the
cost model's layer model, plus that other work; :func:`price_training_memory` prices the same
step's peak by part (FSDP2's sharded state and stream pools, unsharded parameters, what per-op
SAC saves, the loss's FP32 logits, the allocator's reserve). This is not the memory model a
tune uses (:mod:`autoprec.memory`, calibrated by steps measured on the task's device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoprec.costmodel import forward_gemm_seconds, linear_seconds, weight_cast_seconds
from autoprec.devices import DeviceSpec, resolve_target
from autoprec.formats import Format

__all__ = [
    "LLAMA3_8B",
    "STEP_SPECS",
    "price_training_memory",
    "price_training_step",
]

# bytes per element, as torch's dtypes say (the cost model reads them the same way)
_FP32, _BF, _F8 = (torch.float32.itemsize, torch.bfloat16.itemsize,
                   torch.float8_e4m3fn.itemsize)


@dataclass(frozen=True)
class TrainingSetup:
    """A Llama-style decoder trained with FSDP2 as torchtitan runs it: per-op selective
    activation checkpointing, the output layer left in BF16 (torchtitan's float8 filter),
    parameters all-gathered in BF16 (or FP8) and gradients reduced in FP32, AdamW (foreach).
    Shapes are per GPU."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    # sequences per GPU per step
    batch: int = 1
    # GPUs FSDP2 shards the parameters over
    gpus: int = 8
    # torchtitan's per-op SAC saves the output of every other mm of a block: the forward of
    # the others (the 2nd, 4th and 6th linear) is recomputed in backward
    recomputed: tuple[str, ...] = ("wk", "wo", "w3")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each nn.Linear of one block, in call order."""
        h, f = self.hidden, self.intermediate
        kv = self.kv_heads * (h // self.heads)
        return {"wq": (h, h), "wk": (h, kv), "wv": (h, kv), "wo": (h, h),
                "w1": (h, f), "w3": (h, f), "w2": (f, h)}

    def block_linear_params(self) -> int:
        return sum(k * n for k, n in self.linears().values())

    def root_params(self) -> int:
        """The parameters outside the blocks: embedding, output layer, final norm."""
        return 2 * self.vocab * self.hidden + self.hidden

    def params(self) -> int:
        return self.layers * (self.block_linear_params() + 2 * self.hidden) + self.root_params()


# torchtitan's train_configs/llama3_8b.toml (Llama-3-8B: 32 layers, hidden 4096, SwiGLU 14336,
# 32 heads, 8 KV heads, vocabulary 128256; local batch 1 x 8192 tokens, FSDP2 over 8 GPUs,
# per-op SAC, AdamW), the setup of its published float8 measurements.
LLAMA3_8B = TrainingSetup(name="Llama-3-8B, 8 GPUs, FSDP2, local batch 1 x 8192, per-op SAC",
                          layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                          vocab=128256, seq_len=8192)


@dataclass(frozen=True)
class StepSpec:
    """What pricing a whole training step needs beyond a DeviceSpec's GEMMs and copies."""

    # sustained FLOP/s of causal flash attention (SDPA's FlashAttention-2 kernel), forward and
    # backward, counting the causal half of the FLOPs
    attention_flops: tuple[float, float]
    # GPU-to-GPU bytes/s per direction (NVLink), and the fraction NCCL's rings sustain
    link_bandwidth: float
    link_efficiency: float
    # measured seconds of a step / the seconds priced here, every part alike: what a real
    # step costs beyond this model's kernels (power and clock limits under sustained load,
    # collectives slowing the kernels they overlap, the allocator, the host). It changes no
    # ratio of two steps' prices.
    time_scale: float = 1.0
    # the CUDA caching allocator's peak *reserved* bytes / the bytes price_training_memory
    # finds allocated at the step's peak (every pool counted): fragmentation and cached
    # blocks the peak cannot use. torchtitan logs max reserved. 1: allocated bytes only.
    reserved_ratio: float = 1.0


STEP_SPECS: dict[str, StepSpec] = {
    "h100": StepSpec(
        # FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608), FlashAttention-2 on an
        # H100 SXM5, head dim 128, sequence length 8k: forward (causal) 333 TFLOP/s, backward
        # 318 TFLOP/s. Not fitted.
        attention_flops=(333e12, 318e12),
        # H100 SXM datasheet: NVLink 900 GB/s, 450 each way; NCCL's all-gather and
        # reduce-scatter on 8 GPUs taken at 0.8 of it (an assumption, not fitted: FSDP2 hides
        # all but the first and last collectives behind compute, so it barely matters).
        link_bandwidth=450e9, link_efficiency=0.8,
        # Fitted to one measurement, torchtitan's bf16 step (5,760 tokens/s per GPU, 1.422 s
        # per step; torchtitan commit 7a04053's log), which the model prices at 0.892 s; no
        # speed-up was fitted. See calibration.CALIBRATION. A slower machine than the layer model's
        # kernels, as torchao's own linear benchmark found its (pytorch/ao#2185: bf16 linears
        # at 0.49-0.59 of the 989 TFLOP/s peak, where the layer model has 0.78).
        time_scale=1.594,
        # Fitted to one measurement, the same bf16 run's 47.65 GiB (torchtitan's logged
        # memory is torch.cuda.memory_stats()'s "reserved_bytes.all.peak", torchtitan
        # metrics.py DeviceMemoryMonitor.get_peak_stats), which price_training_memory prices
        # at 45.05 GiB allocated: 5.8% reserved beyond it. Every other memory row is held out.
        reserved_ratio=1.0578,
    ),
    "b200": StepSpec(
        # Not fitted, and not measured for this setup: FlashAttention-4's paper reports its
        # B200 forward at up to 1,613 TFLOP/s (BF16, head dim 128), 1.3x cuDNN 9.13's, so
        # cuDNN's (PyTorch SDPA's kernel on sm_100) ~1,240; backward taken at H100's ratio
        # of FlashAttention-2's backward to forward (318 / 333).
        attention_flops=(1240e12, 1184e12),
        # NVLink 5: 1.8 TB/s per GPU, 900 GB/s each way; 0.8 of it, as for the H100.
        link_bandwidth=900e9, link_efficiency=0.8,
        # Fitted to one measurement, torchtitan's nvfp4.md BF16 run (21,919 tokens/s per GPU),
        # which the model prices at 28,896; no speed-up was fitted. See calibration.CALIBRATION["b200"].
        time_scale=1.3183,
    ),
}


def _fp8_or_bf16(fmt: Format | str) -> Format:
    fmt = Format.parse(fmt, where="for a training step")
    if fmt is not Format.BF16 and not fmt.is_scaled:
        raise ValueError(f"A training step is priced in bf16 or a scaled format (an fp8 "
                         f"recipe, mxfp8, nvfp4), not {fmt}; the published setups it is "
                         "checked against run one of those.")
    return fmt


def _step_spec(target: str | DeviceSpec, step: StepSpec | None) -> StepSpec:
    """``step``, or the target's StepSpec (h100's where the target has none)."""
    if step is not None:
        return step
    key, _ = resolve_target(target)
    return STEP_SPECS.get(key) or STEP_SPECS["h100"]


def _check_all_gather(fmt: Format, fp8_all_gather: bool) -> None:
    if fp8_all_gather and not (fmt.is_scaled and fmt.numerics.scaling.one_scale):
        raise ValueError(f"FP8 all-gather needs per-tensor scales (torchao's tensorwise "
                         f"recipe); {fmt} has {fmt.numerics.scaling if fmt.is_scaled else 'none'}.")


def _block_linear(m: int, k: int, n: int, fmt: Format, spec: DeviceSpec,
                  fp8_all_gather: bool) -> float:
    """Forward + backward of one of a block's linears. With FP8 all-gather (tensorwise) the
    weight arrives from FSDP already in FP8 with a precomputed scale: its amax and casts are
    gone, a transposed FP8 copy for the dgrad remains."""
    seconds = linear_seconds(m, k, n, fmt, spec)
    if fmt.is_scaled and fp8_all_gather:
        bw = spec.bandwidth * spec.bandwidth_efficiency
        seconds += max(2 * _F8 * k * n / bw, spec.launch_s) \
            - weight_cast_seconds(k * n, fmt, spec)
    return seconds


def _recompute(m: int, k: int, n: int, fmt: Format, spec: DeviceSpec,
               fp8_all_gather: bool) -> float:
    """The forward of one linear again, as selective checkpointing recomputes it: its GEMM
    and, in FP8, the casts of its operands (SAC saved their amaxes)."""
    g = fmt.numerics.gemms["fwd"]
    seconds = forward_gemm_seconds(m, k, n, fmt, spec)
    if g.is_scaled:
        bw = spec.bandwidth * spec.bandwidth_efficiency
        for numel in (m * k,) + (() if fp8_all_gather else (k * n,)):
            seconds += max((_BF + g.operand_bytes) * numel / bw, spec.launch_s)
    return seconds


def _step_other(setup: TrainingSetup, spec: DeviceSpec, step: StepSpec) -> dict[str, float]:
    """Seconds of the step's work outside the blocks' linears, as modeled (before
    ``other_scale``): memory-bound work at the device's copy bandwidth, bytes in BF16."""
    bw = spec.bandwidth * spec.bandwidth_efficiency
    t, h, L = setup.tokens, setup.hidden, setup.layers
    kv = setup.kv_heads * (h // setup.heads)
    fwd, bwd = step.attention_flops
    causal = 2 * setup.batch * setup.seq_len ** 2 * h  # 4 s^2 d heads / 2 per sequence
    # per block and token, forward: two RMSNorms (read, write h), RoPE on q and k, SwiGLU
    # (read 2 x intermediate, write one), two residual adds; backward moves twice that and
    # SAC recomputes the forward once more
    elementwise = 4 * t * _BF * (2 * 2 * h + 2 * (h + kv) + 3 * setup.intermediate + 2 * 3 * h)
    # the loss upcasts the BF16 logits to FP32, log-softmax saves them, backward and the cast
    # back: ~28 bytes per logit; the embedding's lookup and dense gradient
    loss = t * setup.vocab * 28 + _BF * (4 * t * h + setup.vocab * h)
    # AdamW (foreach, FP32 state) on this GPU's shard: ~80 bytes per parameter over its
    # kernels, and the gradient-norm clipping ~12 more
    optimizer = setup.params() / setup.gpus * 92
    return {"attention": L * (causal / fwd + 2.5 * causal / bwd),
            "elementwise": (L * elementwise + 3 * 2 * _BF * t * h) / bw,
            "loss, embedding": loss / bw, "optimizer": optimizer / bw}


def _exposed_comm(setup: TrainingSetup, step: StepSpec, fp8_all_gather: bool,
                  compute_per_block: float) -> float:
    """FSDP2's collectives that compute does not hide: the root module's (embedding, output
    layer: gathered in forward and again in backward, reduced last), the first block's gather
    and the last block's reduce-scatter; each other block's collectives overlap the
    neighbouring block's compute (FSDP2 prefetches one ahead) unless they take longer."""
    ring = (setup.gpus - 1) / setup.gpus / (step.link_bandwidth * step.link_efficiency)
    weights = setup.block_linear_params()
    block_gather = (weights * (_F8 if fp8_all_gather else _BF) + 2 * setup.hidden * _BF) * ring
    block_reduce = (weights + 2 * setup.hidden) * _FP32 * ring
    root = setup.root_params()
    exposed = 2 * root * _BF * ring + root * _FP32 * ring + block_gather + block_reduce
    per_block = 2 * block_gather + block_reduce
    return exposed + (setup.layers - 1) * max(0.0, per_block - compute_per_block)


def price_training_step(setup: TrainingSetup, fmt: Format | str, target: str | DeviceSpec = "h100",
                        *, fp8_all_gather: bool = False, step: StepSpec | None = None,
                        bf16_tail: int = 0, output: Format | str = "bf16") -> dict[str, float]:
    """Seconds per GPU of one training step of ``setup`` with every block's linear in ``fmt``
    (bf16 or a scaled format; the output layer stays bf16), by part: the blocks' linears and
    their recomputation as :func:`linear_seconds` prices them, the output layer, and the
    work that is not a linear (attention, elementwise, loss, optimizer, FSDP2's exposed
    collectives), each x ``step.time_scale``. ``fp8_all_gather``: FSDP2 gathers the
    linears' weights in FP8 (torchao's tensorwise option). ``bf16_tail``: the last that many
    blocks stay in bf16 (torchtitan's NVFP4 rule). ``output``: the output layer's format
    (torchtitan's MXFP8 converter takes it too). ``step`` defaults to the target's entry in
    ``STEP_SPECS``."""
    fmt, output = _fp8_or_bf16(fmt), _fp8_or_bf16(output)
    _, spec = resolve_target(target)
    step = _step_spec(target, step)
    _check_all_gather(fmt, fp8_all_gather)
    if not 0 <= bf16_tail <= setup.layers:
        raise ValueError(f"bf16_tail={bf16_tail} must be between 0 and the {setup.layers} "
                         "blocks.")
    t, shapes = setup.tokens, setup.linears()
    counts = ((fmt, setup.layers - bf16_tail), (Format.BF16, bf16_tail))
    linears = sum(count * _block_linear(t, k, n, f, spec, fp8_all_gather and f is fmt)
                  for f, count in counts for k, n in shapes.values())
    recompute = sum(count * _recompute(t, *shapes[name], f, spec, fp8_all_gather and f is fmt)
                    for f, count in counts for name in setup.recomputed)
    parts = {"block linears": linears, "recompute (SAC)": recompute,
             f"output layer ({output})": linear_seconds(t, setup.hidden, setup.vocab, output,
                                                        spec)}
    other = _step_other(setup, spec, step)
    compute_per_block = (linears + recompute + other["attention"] + other["elementwise"]) \
        / setup.layers
    other["communication (exposed)"] = _exposed_comm(setup, step, fp8_all_gather,
                                                     compute_per_block)
    parts.update(other)
    return {k: v * step.time_scale for k, v in parts.items()}


# ============================================================================ a step's memory
# What torchtitan's step keeps at its peak, per GPU, as torchtitan ran the published steps
# (commit 7a04053 and its neighbours, Jan-Feb 2025; torch nightly's FSDP2). Sources, for every
# constant below (torchtitan read at cca07028e, Jan 2025, and 88247277c, #820):
# - torchtitan parallelize_llama.py: apply_fsdp (fully_shard per block, reshard_after_forward
#   except for the last block, then the root: embedding, final norm, output layer; param_dtype
#   bf16, reduce_dtype fp32), apply_ac (per-op SAC: _save_list = aten.mm, the SDPA ops,
#   reduce_scatter, and before torchtitan#820 aten.abs and aten.max; every second mm of a
#   block is recomputed), apply_compile (each block compiled; the root, loss, optimizer eager).
# - FSDP2 (torch/distributed/fsdp/_fully_shard, read in torch 2.13): the root is not
#   resharded after forward (_fsdp_state.py, lazy init: post_forward_mesh_info = None);
#   all-gather inputs and outputs are allocated in the all-gather copy-in stream, the reduce-scatter output (the sharded
#   gradient) in the reduce-scatter stream (_fsdp_collectives.py foreach_all_gather,
#   foreach_reduce). The caching allocator keeps a freed block in its stream's pool, where the
#   default stream cannot use it: at the peak those pools are reserved memory.
# - torchtitan train.py: optimizers.zero_grad() (set_to_none) before forward, `del pred`
#   before backward, loss = cross_entropy(pred.flatten(0, 1).float(), labels); RMSNorm
#   (norms.py) computes in fp32: self._norm(x.float()).type_as(x) * weight.
# - torchao float8_linear.py (Jan 2025), matmul_with_hp_or_float8_args: forward saves its
#   input and weight as they came (the BF16 input; rowwise the BF16 weight, tensorwise the FP8
#   weight, which with FP8 all-gather is FSDP's unsharded parameter itself) and casts again in
#   backward. Under compile + SAC the casts are recomputed, so a recipe saves no more than bf16
#   (its per-tensor or per-row scales, under 1 MiB a step, are left out).
_MEMORY_MOMENTS = ("loss backward", "first block's backward")


def _sharded_state(setup: TrainingSetup) -> dict[str, float]:
    """What lives all step, 1/gpus of every parameter (FSDP2 shards on dim 0; padding left
    out): FP32 master weights, AdamW's exp_avg and exp_avg_sq, and the FP32 gradients, which
    zero_grad(set_to_none) frees before forward but whose blocks stay cached in the
    reduce-scatter stream's pool; and the all-gather copy-in stream's pool, sized by its
    largest all-gather: the root's (its BF16 shard in, the unsharded parameters out)."""
    shard = setup.params() / setup.gpus
    root_gather = setup.root_params() * _BF * (1 + 1 / setup.gpus)
    return {"fp32 params (1/gpus)": shard * _FP32,
            "AdamW exp_avg + exp_avg_sq (1/gpus)": 2 * shard * _FP32,
            "fp32 grads (1/gpus, reduce-scatter pool)": shard * _FP32,
            "all-gather pool (root's in + out)": root_gather}


def _unsharded_block(setup: TrainingSetup, fp8_all_gather: bool) -> float:
    """Bytes of one block's unsharded parameters: the linears' weights in BF16, or in FP8 with
    FP8 all-gather; the two norm weights in BF16."""
    return setup.block_linear_params() * (_F8 if fp8_all_gather else _BF) + 2 * setup.hidden * _BF


def _saved_per_block(setup: TrainingSetup) -> float:
    """Bytes one block's per-op SAC keeps for backward (BF16): its input (the checkpoint's),
    the outputs of the mms it saves that backward reads (wq, wv, w1: the 1st, 3rd and 5th;
    w2's, the 7th, is read by nothing, so the compiled partitioner drops it), and flash
    attention's output and FP32 logsumexp (heads x tokens). The rest (norms, RoPE, wk, wo, w3,
    SwiGLU) is recomputed in backward."""
    t, kv = setup.tokens, setup.kv_heads * (setup.hidden // setup.heads)
    saved_mm = {"wq": setup.hidden, "wv": kv, "w1": setup.intermediate}
    return _BF * t * (2 * setup.hidden + sum(saved_mm.values())) + \
        _FP32 * setup.batch * setup.heads * setup.seq_len


def _abs_saves_per_block(setup: TrainingSetup) -> float:
    """Bytes per block that rowwise saved while torchtitan's _save_list held aten.abs (before
    torchtitan#820): rowwise takes amax(abs(x), dim) (aten.amax, not saved), so the abs()
    itself was saved wherever the recompute of a recomputed mm reads it: the abs of its input
    and of its unsharded weight, in BF16. #820's RCA found abs(W3) and abs(input) saved in a
    compiled FFN (w3 is its recomputed mm); wk and wo are the block's other two. 32 blocks of
    this are 10.75 GiB; #808's fixed run used 10.78 GiB less than the buggy one."""
    t, shapes = setup.tokens, setup.linears()
    return _BF * sum(t * shapes[name][0] + shapes[name][0] * shapes[name][1]
                     for name in setup.recomputed)


def _loss_moment(setup: TrainingSetup) -> dict[str, float]:
    """The peak of the loss's backward: log-softmax's saved FP32 output, nll_loss's FP32
    gradient of it and log-softmax's FP32 gradient of its input, all tokens x vocab (the
    BF16 logits and their FP32 copy are freed before backward); and what the eager final
    norm and output layer saved: the norm's FP32 input, its BF16 output, the output layer's
    BF16 input."""
    t = setup.tokens
    return {"loss backward: 3 fp32 logits": 3 * t * setup.vocab * _FP32,
            "final norm + output layer saved": t * setup.hidden * (_FP32 + 2 * _BF)}


def _block_moment(setup: TrainingSetup, fmt: Format, fp8_all_gather: bool) -> dict[str, float]:
    """The peak of the first block backward runs (the last block's), an estimate of what is
    live at once in its FFN's backward: recomputed h, ffn_norm(h), w3's output and w2's input, the gradients of
    the block's output, w2's input, w1's and w3's outputs (BF16); the block's unsharded BF16
    gradients; the next block's all-gather (FSDP2 prefetches one ahead); the output layer's
    unsharded BF16 weight gradient (reduced with the root, at the end); and the recipe's FP8
    copies of a w1/w3 backward's gradient (both axes) and input (rowwise: both axes, and the
    BF16 weight copy of ao#1629's FSDP workaround)."""
    t, h, f = setup.tokens, setup.hidden, setup.intermediate
    work = _BF * t * (3 * h + 5 * f)
    fp8 = 0.0
    if fmt.is_scaled:
        rowwise = not fmt.numerics.scaling.one_scale
        fp8 = _F8 * t * (2 * f + (2 if rowwise else 1) * h) + (_BF * h * f if rowwise else 0)
    return {"block backward: recompute + grads": work + fp8,
            "block's unsharded grads (bf16)": (setup.block_linear_params() + 2 * h) * _BF,
            "prefetched block": _unsharded_block(setup, fp8_all_gather),
            "output layer's unsharded grad": setup.vocab * h * _BF}


def price_training_memory(setup: TrainingSetup, fmt: Format | str,
                          target: str | DeviceSpec = "h100", *, fp8_all_gather: bool = False,
                          sac_saves_abs: bool = False, step: StepSpec | None = None,
                          moment: str | None = None) -> dict[str, float]:
    """Bytes per GPU of ``setup``'s training step at its peak, as torchtitan runs it (FSDP2 over
    ``setup.gpus``, per-op SAC, blocks compiled, every block's linear in ``fmt``), by part: the
    sharded state and the collectives' stream pools, the unsharded parameters held (the root,
    never resharded after forward, and the last block), what SAC saved in every block, and the
    larger of two moments (``moment`` picks one of ``_MEMORY_MOMENTS``): the loss's backward
    (three FP32 tokens x vocab tensors) or the first block's backward; then what the allocator
    reserves beyond it (``step.reserved_ratio``). ``sac_saves_abs``: torchtitan's save list
    still held aten.abs (before torchtitan#820), which costs rowwise the abs() of its inputs
    and weights. The peak is the same on any GPU: ``target`` only picks the StepSpec."""
    fmt = _fp8_or_bf16(fmt)
    step = _step_spec(target, step)
    _check_all_gather(fmt, fp8_all_gather)
    if moment is not None and moment not in _MEMORY_MOMENTS:
        raise ValueError(f"Unknown memory moment {moment!r}; expected one of "
                         f"{', '.join(map(repr, _MEMORY_MOMENTS))} (or None: the larger).")
    parts = _sharded_state(setup)
    parts["unsharded params (root + last block)"] = setup.root_params() * _BF + \
        _unsharded_block(setup, fp8_all_gather)
    parts["SAC saved activations (all blocks)"] = setup.layers * _saved_per_block(setup)
    if sac_saves_abs and fmt.is_scaled and not fmt.numerics.scaling.one_scale:
        parts["SAC saved abs() (pre torchtitan#820)"] = setup.layers * _abs_saves_per_block(setup)
    moments = dict(zip(_MEMORY_MOMENTS, (_loss_moment(setup),
                                         _block_moment(setup, fmt, fp8_all_gather))))
    chosen = moment or max(moments, key=lambda m: sum(moments[m].values()))
    parts.update(moments[chosen])
    reserved = (step.reserved_ratio - 1) * sum(parts.values())
    if reserved:
        parts["reserved, not allocated"] = reserved
    return parts
