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
  ============  =======================================  =======================

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
RMSNorms the engine runs, [Note: unfused RMSNorm]). Outside the layers the model
keeps the final norm's input, lm_head's input, the logits (e*V), their fp32 copy and the fp32
log-softmax the loss saves (4*V + 4*V): ``A_out = 2*e*h + 4 + (e + 8)*V``. Per micro-batch of T
tokens (seq_len x micro_batch_size), with L layers:

    no recomputation:                    T * (L * A_layer + A_out)
    full per-layer recomputation:        T * (L * e*h + A_layer + A_out)

(recomputation keeps each layer's input and rebuilds one layer at a time in backward). Only one
micro-batch's activations are alive at a time. Transient gradients of activations in backward
are not counted (as in Korthikanti et al.).

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

[Note: temporary buffers and the peak]
* Gradient buckets: two buckets of U bytes in flight (one filling, one all-reducing), whenever
  the plan all-reduces gradients (its replica or gradient group has more than one GPU). A bucket
  never holds more than the rank's gradients, e*Phi/sp bytes (the engine sizes its buckets to the
  tensors they hold), so U is capped there; this only matters for models smaller than ~U.
* Gathered parameters when sp > 1: the unit being computed and the one prefetched (two of the
  largest unit), plus the full-size gradients of two units waiting for their reduce-scatter.
  With recomputation the whole layer gathered for the recompute forward is kept for its
  backward, so the largest layer replaces one of the two units.
* Owned-tensor buffers: in mixed precision the owner steps its fp32 master copy with fp32
  gradients, 4 bytes per owned parameter (Phi/sos); when sos > sp, one bucket-sized staging
  buffer for the broadcast of updated parameters.
The first two live during backward, next to the activations; the owned-tensor buffers fill up
as the last backward's buckets are reduced, i.e. while backward is freeing activations, and
peak at the optimizer step. Memory in that window is about A*(1-f) + F*f for a fraction f of
backward done, whose maximum is at an end, so the peak is

    D_total = D_modelstate + max(activations + buckets + gathered, owned fp32 grads + staging)

and ``tmp`` is reported as that maximum minus the activations (so the five parts add up to
the total). Summing everything instead would charge 4*Phi/sos twice over (16 GB for LLaMA-30B
at sos = 8) and push the search to shard more than it must.

Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
}


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
    activations: int
    tmp: int
    tmp_parts: dict  # the buffers (bytes) and which phase sets the peak

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.activations + self.tmp

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def activation_bytes(spec: ModelSpec, training: TrainingSpec) -> int:
    """Activation bytes of one micro-batch (see the Note)."""
    e = param_bytes(training.precision)
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    # + 8h: the two RMSNorms as HF runs them, unfused (see [Note: unfused RMSNorm])
    a_layer = e * (4 * h + 2 * q + 2 * kv + 4 * i) + 8 * h + 4 * spec.num_heads + 8
    a_out = 2 * e * h + 4 + (e + 8) * spec.vocab_size
    if training.recompute:
        per_token = spec.num_layers * e * h + a_layer + a_out
    else:
        per_token = spec.num_layers * a_layer + a_out
    return training.tokens_per_micro_batch * per_token


def _tmp_parts(spec: ModelSpec, plan: Plan, training: TrainingSpec, *,
               gpus_per_node: int, num_nodes: int) -> dict[str, int]:
    e, g = param_bytes(training.precision), grad_bytes(training)
    U = min(training.bucket_bytes, g * spec.num_params // plan.sp)
    replica = (gpus_per_node // plan.s0_p) * (num_nodes // plan.s1_p)
    grad_group = plan.sg // plan.sp
    parts = {"buckets": 2 * U if (replica > 1 or grad_group > 1) else 0}
    gathered = 0
    if plan.sp > 1:
        unit_sizes = [n for _, n in spec.layer_units(training.granularity)]
        unit_sizes += [n for _, n in spec.outside_params()]
        largest = max(unit_sizes)
        held = spec.params_per_layer if training.recompute else largest
        gathered = e * (held + largest) + g * 2 * largest  # reduce-scatter inputs: reduce dtype
    parts["gathered_params"] = gathered
    mixed = training.precision != "fp32"
    parts["owned_fp32_grads"] = int(4 * spec.num_params / plan.sos) if mixed else 0
    parts["broadcast_staging"] = U if plan.sos > plan.sp else 0
    return parts


def memory_breakdown(
    spec: ModelSpec, plan: Plan, training: TrainingSpec, *, gpus_per_node: int, num_nodes: int,
) -> MemoryBreakdown:
    """Per-GPU bytes of ``plan``."""
    phi = spec.num_params
    e, g = param_bytes(training.precision), grad_bytes(training)
    k = optimizer_bytes_per_param(training.optimizer, training.precision)
    parts = _tmp_parts(spec, plan, training, gpus_per_node=gpus_per_node, num_nodes=num_nodes)
    act = activation_bytes(spec, training)
    backward = parts["buckets"] + parts["gathered_params"]
    step = parts["owned_fp32_grads"] + parts["broadcast_staging"]
    parts["peak_phase"] = "backward" if act + backward >= step else "optimizer step"
    return MemoryBreakdown(
        params=int(e * phi / plan.sp),
        grads=int(g * phi / plan.sg),
        optim=int(k * phi / plan.sos),
        activations=act,
        tmp=max(backward, step - act),
        tmp_parts=parts,
    )
