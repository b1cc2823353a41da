"""Per-GPU memory of a plan: model states, activations and temporary buffers (paper Sec. IV-D).

    D_total = D_modelstate + D_activation + D_tmp        (the paper's Eq. 2 compares it with
                                                           the GPU's memory; D_tmp is what the
                                                           peak adds to the activations)

[Note: model states, generalised from the paper's Eq. D_modelstate]
The paper writes D_modelstate = 2Phi/sp + 2Phi/sg + 12Phi/sos for mixed-precision AdamW. We keep
its shape, ``P*Phi/sp + G*Phi/sg + K*Phi/sos``, and take the bytes per parameter from the
precision and the optimizer:

* P (parameters): 2 bytes in bf16/fp16, 4 in fp32. G (gradients): the bytes of the dtype they
  are reduced and accumulated in (``TrainingSpec.grad_dtype``: the engine's reduce_dtype, 4 for
  "fp32"; the precision's when not given, as in the paper).
* K (optimizer states, everything the owner keeps to step its parameters):

  ============  =======================================  =======================
  optimizer     bf16 / fp16 (fp32 master copy kept)       fp32 (no master copy)
  ============  =======================================  =======================
  adamw         4 master + 4 m + 4 v = 12  (the paper)    4 m + 4 v = 8
  sgd-momentum  4 master + 4 momentum = 8                 4
  lion          4 master + 4 momentum = 8                 4
  adam8bit      4 master + 1 m + 1 v + 8/2048 = 6.004     2.004
  muon          4 master + 4 momentum = 8                 4
  adafactor     4 master + 0 = 4                          0
  ============  =======================================  =======================

  Muon's row is its hidden matrices' (the AdamW it runs for the rest is not counted apart);
  Adafactor (no first moment) keeps one row and one column vector per matrix, O(m + n), taken
  as 0 bytes per parameter.

[Note: whole-tensor optimizers]
Muon and Adafactor read each tensor whole, and the engine balances their owners by the
optimizer's work, not by bytes, under a byte cap: an owner holds at most total/b + the largest
tensor (runtime/optim/ownership.py [Note: owners balanced by the optimizer's work]). So a
rank's optimizer states are not K*Phi/sos but at most, with X the largest tensor and
b = sos/sp the optim_bcast owners (X only when b > 1: one owner holds everything exactly):
* sp = 1: W = Phi/sos + X whole tensors, K*W (the masters are in K, or the parameters in fp32);
* sp > 1: the b groups are capped as above, then inside a param_shard group one rank steps
  each tensor whole (runtime/optim/whole_tensor.py), capped again: a rank holds the rows
  R = Phi/sos + X/sp of its group's tensors and whole tensors W = R + X; K*W plus 4 bytes for
  the copy beside them: the fp32 rows (4*R) in mixed precision, the whole fp32 masters (4*W)
  in fp32, where the rows are the parameters.
These are the bounds the planner charges. The step's exchange buffers (sp > 1, send and
receive, fp32) add 2*4*Phi/sos to the optimizer-step moment.

  8-bit Adam stores m and v as one byte each plus one fp32 absmax per block of 2048 values per
  state (Dettmers et al. 2022, block-wise quantisation).

[Note: gradients at M = 1]
G*Phi/sg is what the engine holds while gradients accumulate over micro-batches (the sharded
``.grad`` or the keeper's buffer, grad_sync.py). With one micro-batch nothing accumulates: each
gradient goes into a bucket as it is produced and, once reduced, the rank keeps only what it
owns, so the engine holds G*Phi/sos whatever sg is (``amsp tune``, small-llama, M = 1: ZeRO-1
20.3 MiB of model states measured against 28.9 MiB here; at M = 4, 28.9 measured). The planner
keeps the formula on purpose: a plan chosen at M = 1 must still fit when the job raises M, and
at M = 1 sg = sp and sg = sos run the same collectives, so nothing is lost by it.

[Note: FSDP2's padding]
With sp > 1 the engine shards every tensor on dim 0 with FSDP2, which pads dim 0 to a multiple
of sp: a rank stores ceil(d0/sp) rows of each tensor. So wherever the sp-sharded tensors are
counted (parameters, their gradients, the masters and moments of the shards a rank owns) the
model takes ``ModelSpec.padded_params(sp)`` elements, not Phi. Invariant: equal to Phi where
every dim 0 divides sp (every LLaMA preset up to sp = 256 without TP); it grows where sp nears
a dim 0 (sp = 1,024 on a TP 8 shard of LLaMA-65B: gate's and up's 2,752 rows take 3 per rank).
The baselines are priced with the engine's layout too; DeepSpeed pads only its flat partition,
so at such sp the model charges its ZeRO-3 a little more than it holds. The communication terms
(cost.py) count Phi.

[Note: activations (Korthikanti et al. 2022, re-derived for LLaMA)]
Megatron-LM's count, ``sbh(34 + 5as/h)`` bytes per GPT layer, lists the tensors each layer saves
for backward. We redo that list for a LLaMA layer run with a flash-attention-style kernel (which
saves Q, K, V, its output and one fp32 logsumexp per head and token, never the s x s scores) and
fused RMSNorms (which save their input and one fp32 1/rms per token). No dropout (LLaMA has
none). With e bytes per activation element (2 in bf16/fp16, 4 in fp32), h the hidden size,
q = heads*head_dim, kv = kv_heads*head_dim, i the MLP width, a the heads and V the vocabulary,
the bytes one decoder layer keeps per token are

    A_layer = e*(h + h)          attention RMSNorm input; its output, the q/k/v input
            + e*(q + 2*kv)       Q and K after RoPE, V (flash-attention inputs)
            + e*q + 4*a          attention output (also o_proj's input); fp32 logsumexp
            + e*(h + h)          MLP RMSNorm input; its output, the gate/up input
            + e*4*i              gate out, SiLU(gate out), up out, their product (down input)
            + 2*4                the two norms' fp32 1/rms
            = e*(4h + 2q + 2kv + 4i) + 4a + 8

(for LLaMA-7B in bf16: 37.5*h bytes per token, against GPT's 34*h; 45.5*h with the unfused
RMSNorms the engine runs, [Note: unfused RMSNorm]). Outside the layers the model keeps what
the final (unfused) norm keeps, 4h + e*h + e*h + 4 (its output is lm_head's input), and the fp32
log-softmax the loss saves for its backward, 4*V: ``A_out = 4*h + 2*e*h + 4 + 4*V``. The logits
(e*V) and their fp32 copy (4*V) are alive at the end of the forward only: neither is saved for
backward, and the loop drops the logits once the loss is computed ([Note: the loss's
gradients]). Per micro-batch of T tokens (seq_len x micro_batch_size), with L layers, forward
keeps

    no recomputation:                    T * (L * A_layer + A_out)
    full per-layer recomputation:        T * (L * e*h + A_out)

(recomputation keeps each layer's input; the layer it rebuilds in backward is a temporary buffer
of the layer-backward moment, [Note: temporary buffers and the peak]). Only one micro-batch's
activations are alive at a time. Transient gradients of activations in backward are not counted
here (as in Korthikanti et al.); the layer-backward moment charges the one flowing into the layer.

[Note: unfused RMSNorm]
The count above assumes fused RMSNorms. The engine runs HF's LlamaRMSNorm, which is unfused:
it casts its input to fp32 (``x.to(float32)``, kept by ``pow`` and the ``* rsqrt`` product), keeps
the normalised tensor cast back to e bytes (the weight product's input) and its output (the next
Linear's input), and the fp32 1/rms: 4h + e*h + e*h + 4 bytes per token, where the list above
has e*h + e*h + 4 (its input was the residual stream, which the unfused norm does not keep; in
fp32 the cast is a no-op and that input is the kept fp32 tensor). So each norm keeps 4h bytes
more, 8h per layer in any precision. Found by the dry run (LLaMA-7B, 1,024 ranks, bf16, seq 4096:
engine 23.38 GiB of activations, the fused count 20.05 GiB) and read off one decoder layer's
saved tensors under FakeTensorMode (``saved_tensors_hooks``): 187,016 bytes per token, where the
fused count is 153,736; the difference is 8h = 32,768 plus RoPE's cos and sin (2 x 256 bytes,
computed once per model and shared by every layer: left out). LLaMA-7B in bf16: 45.5 h per
token per layer.

[Note: the loss's gradients]
The first thing backward does is the loss's: the NLL's gradient with respect to the fp32
log-probabilities and the log-softmax backward's gradient with respect to the fp32 logits, two
fp32 T x V tensors, 8*T*V bytes, while every activation forward kept is still alive. For a
LLaMA vocabulary that is the peak of the whole step: the dry run (1,024 ranks, seq 4096, bf16)
found 0.98 GiB of temporaries at the peak of LLaMA-7B and -13B under every plan it ran, which is
8 x 4096 x 32,000 bytes, and a 4-layer probe (h 1024, seq 1024) found exactly two 125 MiB fp32
tensors beside the 125 MiB log-softmax. The model charged neither before, and charged the logits
and their fp32 copy as activations instead (A_out's (e + 8) V, what is alive at the end of the
forward, not at the peak).

[Note: temporary buffers and the peak]
Memory peaks at one of three moments of a step; each has its own activations and temporary
buffers, and the peak is the largest (``moments``; MemoryBreakdown reports the categories of
the one that wins, so they compare with the dry run's categories at the engine's peak):

* loss backward: every kept activation (above) plus the loss's gradients, 8*T*V.
* layer backward, the first decoder layer's: the head's activations (A_out) are freed, the
  layers' are still alive (with recomputation only their inputs, L*e*h), and the backward
  allocates
  - the recomputed layer, T*A_layer, with recomputation;
  - gradient buckets, whenever the plan all-reduces gradients (its replica or gradient group
    has more than one GPU): up to 2U in flight (planner/buckets.py [Note: bytes in flight]) and the
    bucket being filled, U, or alone the largest gradient tensor of a layer when that is larger
    (g*n bytes). With sp > 1 a unit is never split (planner/buckets.py [Note: a sharded unit is
    one bucket]): where a layer unit's shard (g*n/sp) is larger than U, two of them in flight and
    a third filling. Never more than the rank's gradients, g*Phi/sp (the engine sizes its buckets
    to the tensors they hold; U is capped there too). The gradient being copied into its bucket
    (e*n) is not charged here: it is gradient storage, which the grads category holds. Measured
    (dry run of LLaMA-30B with recomputation, bf16 reduction, 128 MiB buckets): at the peak,
    inside the last layer's down_proj backward, three 84.5 MiB attention gradients in flight
    (253.5 MiB <= 2U) and the 227.5 MiB down_proj bucket beside the recomputed layer;
  - gathered parameters when sp > 1, and one unit's unsharded gradients in the reduce dtype,
    the reduce-scatter's input (the dry run of a 2-layer LLaMA-7B under ZeRO-3 holds one such
    760 MiB fp32 input at its layer peak). Without recomputation: the unit being computed and
    the one prefetched, two of the largest unit. With it: the whole layer, which the
    recomputation gathered and its backward still uses; the next unit in backward order is
    inside that layer, so nothing more is prefetched, unless a unit is a whole layer
    (granularity "layer"), when the previous layer is prefetched beside it;
  - the gradient flowing into the layer, T*e*h.
  Measured (``amsp dryrun``, LLaMA-65B widths, seq 4096, bf16, module units, recomputation,
  ``p=4x1,g=4x1,os=8x128`` at 1,024 ranks and TP 2 ``p=2x1,g=2x1,os=4x64`` at 8,192): the peak is
  in the second layer's backward (in backward order), inside down_proj's; alive are that
  layer's recomputed activations (all of A_layer), the layer gathered whole, down_proj's
  unsharded gradient, the previous layer's gradients in flight, the incoming gradient, and the
  L - 1 layer inputs not yet consumed. The planner charges L inputs (one more, 1/L of them).
* both backward moments, when sp > 1: the root unit, gathered whole since the forward
  ([Note: the root unit's memory]).
* optimizer step: the activations are gone; in mixed precision the owner steps its fp32 master
  copy with fp32 gradients, 4 bytes per owned parameter (Phi/sos), and when sos > sp one
  bucket-sized staging buffer holds the broadcast of updated parameters.

    D_total = D_modelstate + max(loss backward, layer backward, optimizer step)

[Note: the root unit's memory]
With sp > 1 the parameters outside the layers are one unit (runtime/sync/units.py [Note: one
root unit]) that FSDP2 gathers at the start of the forward and keeps gathered until its
reduce-scatter after the backward: e*Phi_root bytes at both backward moments
(``root_gathered``; the dry run files them as temporaries). From lm_head's backward on, the
gradients autograd accumulates on the gathered final norm and lm_head (the embedding's too,
when tied: it is lm_head's weight) wait unsharded, in the compute dtype, for that one
reduce-scatter: e*(Phi_root - embedding) at the layer-backward moment (``root_grads``; the
whole root when tied). FSDP2 pays the same for its root group. The layer units' gathers stay
as below: two of the largest layer unit and one reduce-scatter input.

Summing every buffer instead would charge 4*Phi/sos twice over (16 GB for LLaMA-30B at sos = 8)
and push the search to shard more than it must.

Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from amsp_ext.choices import WHOLE_TENSOR_OPTIMIZERS
from amsp_ext.planner.buckets import IN_FLIGHT_BUCKETS
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.specs import TrainingSpec

__all__ = [
    "MemoryBreakdown",
    "activation_bytes",
    "memory_breakdown",
    "optimizer_bytes_per_param",
    "grad_bytes",
    "param_bytes",
]

_MASTER = 4  # fp32 master copy kept by mixed-precision optimizers
_STATE_BYTES = {  # optimizer state bytes per parameter, master copy excluded
    "adamw": 8.0,
    "sgd-momentum": 4.0,
    "lion": 4.0,
    "adam8bit": 2.0 + 2 * 4 / 2048,
    "muon": 4.0,
    "adafactor": 0.0,
}


def whole_tensor_rows(training: TrainingSpec, plan: Plan) -> bool:
    """The engine steps whole tensors on whole owners ([Note: whole-tensor optimizers])."""
    return training.optimizer in WHOLE_TENSOR_OPTIMIZERS and plan.sp > 1


def _largest_tensor(spec: ModelSpec) -> int:
    """An upper bound of the largest parameter: the largest Linear or outside unit."""
    return max([n for _, n in spec.layer_units("module")] + [n for _, n in spec.outside_params()])


def _whole_tensor_optim(spec: ModelSpec, plan: Plan, precision: str, *, phi: float, k: float) -> float:
    """The bound of a rank's optimizer bytes under a whole-tensor optimizer ([Note:
    whole-tensor optimizers])."""
    big = _largest_tensor(spec)
    over = big if plan.sos // plan.sp > 1 else 0  # the optim_bcast owners' cap
    if plan.sp == 1:
        return k * (phi / plan.sos + over)
    rows = phi / plan.sos + over / plan.sp
    whole = rows + big
    return k * whole + 4 * (rows if precision != "fp32" else whole)


def param_bytes(precision: str) -> int:
    """Bytes of one parameter (and one gradient, one activation element) in ``precision``."""
    return 4 if precision == "fp32" else 2


def grad_bytes(training: TrainingSpec) -> int:
    """Bytes of one reduced or accumulated gradient element (``training.grad_dtype``)."""
    return param_bytes(training.grad_dtype)


def optimizer_bytes_per_param(optimizer: str, precision: str) -> float:
    mixed = precision != "fp32"
    return _STATE_BYTES[optimizer] + (_MASTER if mixed else 0)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    params: int
    grads: int
    optim: int
    activations: int  # at the peak moment; kept_activations: what forward keeps
    tmp: int  # at the peak moment
    tmp_parts: dict  # the buffers (bytes) and which moment sets the peak ("peak_phase")
    moments: dict  # moment -> {"activations": n, "tmp": n}, see [Note: temporary buffers and the peak]
    startup: int = 0  # [Note: start-up memory]

    @property
    def step_total(self) -> int:
        return self.params + self.grads + self.optim + self.activations + self.tmp

    @property
    def total(self) -> int:
        """The larger of the step's peak and the start-up's: a plan fits only if it can start."""
        return max(self.step_total, self.startup)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def kept_activations(self) -> int:
        """What the forward of one micro-batch keeps for backward (activation_bytes)."""
        return self.moments["loss backward"]["activations"]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        d["step_total"] = self.step_total
        return d


def _layer_activations_per_token(spec: ModelSpec, e: int) -> int:
    """A_layer (see the Note); + 8h: the two RMSNorms as HF runs them ([Note: unfused RMSNorm])."""
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    return e * (4 * h + 2 * q + 2 * kv + 4 * i) + 8 * h + 4 * spec.num_heads + 8


def _head_activations_per_token(spec: ModelSpec, e: int) -> int:
    """A_out: the final unfused norm's kept tensors and the fp32 log-softmax."""
    h = spec.hidden_size
    return 4 * h + 2 * e * h + 4 + 4 * spec.vocab_size


def activation_bytes(spec: ModelSpec, training: TrainingSpec) -> int:
    """Activation bytes the forward of one micro-batch keeps for backward (see the Note)."""
    e = param_bytes(training.precision)
    per_layer = e * spec.hidden_size if training.recompute else _layer_activations_per_token(spec, e)
    per_token = spec.num_layers * per_layer + _head_activations_per_token(spec, e)
    return training.tokens_per_micro_batch * per_token


def _largest_layer_tensor(spec: ModelSpec) -> int:
    return max(n for kind, n in spec.layer_module_params() if kind != "norms")


def _tmp_parts(spec: ModelSpec, plan: Plan, training: TrainingSpec, *, phi: int,
               gpus_per_node: int, num_nodes: int) -> dict[str, int]:
    """The buffers of [Note: temporary buffers and the peak]; ``phi``: the padded model size."""
    e, g = param_bytes(training.precision), grad_bytes(training)
    T = training.tokens_per_micro_batch
    rank_grads = g * phi // plan.sp
    U = min(training.bucket_bytes, rank_grads)
    replica = (gpus_per_node // plan.s0_p) * (num_nodes // plan.s1_p)
    grad_group = plan.sg // plan.sp
    if plan.sp > 1:  # planner/buckets.py [Note: a sharded unit is one bucket]
        filling = max(U, g * max(n for _, n in spec.layer_units(training.granularity)) // plan.sp)
        in_flight = IN_FLIGHT_BUCKETS * filling
    else:
        filling, in_flight = max(U, g * _largest_layer_tensor(spec) // plan.sp), IN_FLIGHT_BUCKETS * U
    parts = {"loss_grads": 8 * T * spec.vocab_size,
             "recomputed_layer": T * _layer_activations_per_token(spec, e) if training.recompute else 0,
             "buckets": min(in_flight + filling, rank_grads) if (replica > 1 or grad_group > 1) else 0,
             "layer_grad_in": T * e * spec.hidden_size}
    parts["gathered_params"] = _gathered_bytes(spec, plan, training) if plan.sp > 1 else 0
    parts["root_gathered"], parts["root_grads"] = _root_bytes(spec, e) if plan.sp > 1 else (0, 0)
    mixed = training.precision != "fp32"
    parts["owned_fp32_grads"] = int(4 * phi / plan.sos) if mixed else 0
    parts["broadcast_staging"] = U if plan.sos > plan.sp else 0
    return parts


def _gathered_bytes(spec: ModelSpec, plan: Plan, training: TrainingSpec) -> int:
    """Gathered parameters and one reduce-scatter input at the layer-backward moment (see
    [Note: temporary buffers and the peak])."""
    e, g = param_bytes(training.precision), grad_bytes(training)
    layer_units = [n for _, n in spec.layer_units(training.granularity)]
    reduced = g * max(layer_units)
    if training.recompute:
        prefetched = max(layer_units) if training.granularity == "layer" else 0
        return e * (spec.params_per_layer + prefetched) + reduced
    largest = max(layer_units)  # the root unit is charged apart ([Note: the root unit's memory])
    return 2 * e * largest + g * largest


def _root_bytes(spec: ModelSpec, e: int) -> tuple[int, int]:
    """(the root unit gathered, its unsharded gradients at the layer-backward moment) when
    sp > 1 ([Note: the root unit's memory])."""
    outside = dict(spec.outside_params())
    root = sum(outside.values())
    waiting = root if spec.tie_word_embeddings else root - outside["embedding"]
    return e * root, e * waiting


def startup_bytes(spec: ModelSpec, plan: Plan, training: TrainingSpec) -> int:
    """[Note: start-up memory]
    A model built on meta starts (runtime/materialize.py) with its local parameters in the
    compute dtype (e*Phi/sp), the owners' fp32 masters (4*Phi/sos under mixed precision; under
    fp32 the masters are the parameters) and, while the initializer runs, one module's
    parameters built whole in fp32: the largest of the embedding, the LM head and a layer's
    linears. Loading from files needs less (one tensor's rows). No gradient or optimizer moment
    exists yet, so this is below the step's peak for every model the planner has priced; it is
    checked all the same, since a plan that cannot start does not fit."""
    e = param_bytes(training.precision)
    phi = spec.padded_params(plan.sp)  # [Note: FSDP2's padding]
    masters = 4 * phi // plan.sos if training.precision != "fp32" else 0
    largest = max([_largest_layer_tensor(spec), *(n for _, n in spec.outside_params())])
    return int(e * phi / plan.sp) + masters + 4 * largest


def memory_breakdown(
    spec: ModelSpec, plan: Plan, training: TrainingSpec, *, gpus_per_node: int, num_nodes: int,
) -> MemoryBreakdown:
    """Per-GPU bytes of ``plan`` at its peak moment (see [Note: temporary buffers and the peak])."""
    phi = spec.padded_params(plan.sp)  # [Note: FSDP2's padding]
    e, g = param_bytes(training.precision), grad_bytes(training)
    k = optimizer_bytes_per_param(training.optimizer, training.precision)
    parts = _tmp_parts(spec, plan, training, phi=phi, gpus_per_node=gpus_per_node, num_nodes=num_nodes)
    kept = activation_bytes(spec, training)
    head = training.tokens_per_micro_batch * _head_activations_per_token(spec, e)
    moments = {
        "loss backward": {"activations": kept, "tmp": parts["loss_grads"] + parts["root_gathered"]},
        "layer backward": {"activations": kept - head,
                           "tmp": sum(parts[k] for k in ("recomputed_layer", "buckets", "gathered_params",
                                                         "root_gathered", "root_grads", "layer_grad_in"))},
        "optimizer step": {"activations": 0, "tmp": parts["owned_fp32_grads"] + parts["broadcast_staging"]},
    }
    optim = k * phi / plan.sos
    if training.optimizer in WHOLE_TENSOR_OPTIMIZERS:
        optim = _whole_tensor_optim(spec, plan, training.precision, phi=phi, k=k)
    if whole_tensor_rows(training, plan):  # [Note: whole-tensor optimizers]
        parts["whole_tensor_exchange"] = int(2 * 4 * phi / plan.sos)
        moments["optimizer step"]["tmp"] += parts["whole_tensor_exchange"]
    peak = max(moments, key=lambda m: moments[m]["activations"] + moments[m]["tmp"])  # ties: first
    parts["peak_phase"] = peak
    return MemoryBreakdown(
        params=int(e * phi / plan.sp * (1 + training.frozen_models)),  # specs.py [Note: frozen models]
        grads=int(g * phi / plan.sg),
        optim=int(optim),
        activations=moments[peak]["activations"],
        tmp=moments[peak]["tmp"],
        tmp_parts=parts,
        moments=moments,
        startup=startup_bytes(spec, plan, training),
    )
