"""Tensor parallelism inside the node, priced with AMSP over the data-parallel world.

[Note: a TP job is an AMSP job of TP shards]
With a tensor-parallel degree T (Megatron-LM's layout, Shoeybi et al. 2019, without sequence
parallelism), the T GPUs of a TP group hold one T-th of every decoder layer's matrices and run
one micro-batch together; the (R/T) x N ranks that hold the same TP shard form the
data-parallel world AMSP shards over. So the planner prices a TP job as an AMSP job on that
world whose model is one TP rank's shard (``tp_shard_spec``): every term of the memory model,
Eq. 1-7 and the step model then holds as written, the six factors' s0 divide R/T, and M
follows from the data-parallel world (global batch = (R/T) x N x micro-batch x M x seq).
What TP adds on top is its own communication (``TPComm``), on the critical path.
Invariant: at T = 1 the shard is the model and the world the cluster, so nothing changes.
This is the review's "serving as the data-parallel backend" reading of AMSP (sdp the
data-parallel group size) and its joint search of stp with the six factors (planner/joint.py).
Not modelled: sequence parallelism (reduce-scatter/all-gather instead of the all-reduces, and
the replicated activations divided by T too) and pipeline parallelism.

The shard, per TP rank (h hidden, i MLP width, a heads, kv KV heads, V vocabulary):
* q/k/v and gate/up are column-parallel, o and down row-parallel: a/T heads, kv/T KV heads and
  i/T MLP columns per rank; a row-parallel bias (o's, down's) is replicated.
* RMSNorm weights are replicated (every rank normalises the full hidden state).
* Embedding and lm_head are whole on every TP rank, and so are the logits and the loss: the
  layout the engine runs (runtime/tensor_parallel.py ``parallelize_llama``), so the planner
  prices the job that runs. Invariant: the planner's shard is the engine's; a vocab-parallel
  layout (Megatron's) would divide their memory by T and add the all-reduces below to price.
* FLOPs per rank are the shard's: compute time divides by T (ideal TP scaling: the narrower
  matrices are assumed to run at the same efficiency, optimistic for small h/T).

Activations (memory.py [Note: activations]), re-derived per TP rank as Korthikanti et al. 2022
do for GPT (``sbh(10 + 24/t + 5as/(ht))``): without sequence parallelism the tensors before a
column-parallel layer are replicated on every rank and those between a column- and a
row-parallel layer are split. Of A_layer = e(4h + 2q + 2kv + 4i) + 8h + 4a + 8:
* replicated: the two norms' inputs and outputs (e*4h: the residual stream and the q/k/v and
  gate/up inputs), the unfused norms' fp32 copies (8h) and 1/rms (8);
* split by T: Q, K, V and the attention output (e(2q + 2kv)), the fp32 logsumexp (4a) and the
  MLP's four i-wide tensors (e*4i).
That is exactly ``_layer_activations_per_token`` of the shard. With recomputation each layer
keeps its input, e*h, replicated.

Communication per micro-batch of b x s tokens, each TP all-reduce of b*s*h*e bytes (e the
compute dtype's bytes; 2 in bf16) on the T x 1 mesh of the node:
* forward: 2 per layer (after o and after down, the row-parallel outputs);
* backward: 2 per layer (the input gradients of q/k/v and of gate/up);
* none outside the layers: the whole embedding's output and lm_head's input gradient are the
  same on every TP rank;
* with recomputation the backward re-runs each layer's forward, but only 1 more per layer: torch's
  non-reentrant checkpoint stops re-running a layer once the tensors its backward needs are back
  (early stop), which is before the MLP's row-parallel output and its all-reduce (``amsp dryrun
  --tensor-parallel --recompute`` logs 3 per layer in backward; tests/test_dryrun.py).
They are priced by the profile's all-reduce on a T x 1 mesh, whose "all groups active" reading
is the R/T TP groups of a node at once (profile.py [Note: contention between the groups of one
shape]; intra-node meshes are not scaled, as elsewhere). They are not overlapped with compute
(each one's result is the next operator's input), so the step model adds them to the compute
thread (step.py); the objective "comm" adds them as ``t_tp`` to Eq. 1. Whether they contend
with AMSP's intra-node collectives running at the same time is not modelled (step.py: streams
are independent).

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from amsp_ext.choices import TENSOR_PARALLEL_DEGREES as TP_DEGREES  # what "auto" searches
from amsp_ext.planner.memory import param_bytes
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import is_auto
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import TrainingSpec

__all__ = ["TP_DEGREES", "TPComm", "TensorParallelError", "check_tensor_parallel", "parse_tensor_parallel",
           "tp_comm", "tp_degrees", "tp_shard_spec"]



class TensorParallelError(ValueError):
    """A tensor-parallel degree the model or the node cannot take. One line, naming the field."""


def _limits(spec: ModelSpec, gpus_per_node: int) -> list[tuple[str, int]]:
    return [("gpus_per_node", gpus_per_node), ("num_attention_heads", spec.num_heads),
            ("num_key_value_heads", spec.num_kv_heads), ("intermediate_size", spec.intermediate_size)]


def tp_degrees(spec: ModelSpec, gpus_per_node: int) -> tuple[int, ...]:
    """The degrees of TP_DEGREES that divide the node and the model's heads, KV heads and MLP."""
    return tuple(t for t in TP_DEGREES if all(n % t == 0 for _, n in _limits(spec, gpus_per_node)))


def check_tensor_parallel(degree: int, spec: ModelSpec, gpus_per_node: int) -> None:
    """One-line TensorParallelError naming the first field ``degree`` does not divide."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree not in TP_DEGREES:
        raise TensorParallelError(f"tensor_parallel must be one of {', '.join(map(str, TP_DEGREES))}"
                                  f" (or auto), got {degree!r}")
    allowed = ", ".join(map(str, tp_degrees(spec, gpus_per_node)))
    for field, n in _limits(spec, gpus_per_node):
        if n % degree:
            where = "" if field == "gpus_per_node" else f"the model {spec.name}'s "
            raise TensorParallelError(f"tensor_parallel={degree} must divide {where}{field}={n} "
                                      f"(allowed here: {allowed})")


def parse_tensor_parallel(text: str | int, *, flag: str = "--tensor-parallel") -> int | None:
    """``"auto"`` -> None, ``"2"`` -> 2; anything else a one-line error naming ``flag``."""
    if is_auto(text):
        return None
    try:
        degree = int(text)
    except (TypeError, ValueError):
        degree = None
    if degree not in TP_DEGREES or isinstance(text, bool):
        raise TensorParallelError(f"{flag} must be one of {', '.join(map(str, TP_DEGREES))} or auto, "
                                  f"got {text!r}")
    return degree


def tp_shard_spec(spec: ModelSpec, degree: int) -> ModelSpec:
    """One TP rank's shard of ``spec`` (see the Note); ``spec`` itself at degree 1."""
    if degree == 1:
        return spec
    return replace(spec, intermediate_size=spec.intermediate_size // degree,
                   num_heads=spec.num_heads // degree, num_kv_heads=spec.num_kv_heads // degree)


@dataclass(frozen=True, kw_only=True)
class TPComm:
    """One micro-batch's TP all-reduces (see the Note): how many, their bytes and seconds."""

    degree: int
    num_layers: int
    recompute: bool
    activation_bytes: int  # one activation all-reduce: b*s*h*e
    activation_s: float  # its time on the T x 1 mesh

    @property
    def layer_forward(self) -> int:
        """Activation all-reduces per layer in forward (and in backward)."""
        return 2 if self.degree > 1 else 0

    @property
    def layer_count(self) -> int:
        """One layer's TP all-reduces in one micro-batch: forward, backward and, with
        recomputation, the attention's again (see the Note: the re-run stops before the MLP's)."""
        if self.degree == 1:
            return 0
        return 2 * self.layer_forward + (1 if self.recompute else 0)

    @property
    def layer_bytes(self) -> int:
        """One layer's TP bytes in one micro-batch."""
        return self.layer_count * self.activation_bytes

    @property
    def layer_s(self) -> float:
        return self.layer_count * self.activation_s

    @property
    def per_micro_batch_s(self) -> float:
        return self.num_layers * self.layer_s

    @property
    def per_micro_batch_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def as_dict(self) -> dict:
        return {"degree": self.degree, "activation_allreduce_bytes": self.activation_bytes,
                "activation_allreduce_s": self.activation_s, "layer_bytes": self.layer_bytes,
                "layer_s": self.layer_s, "per_micro_batch_bytes": self.per_micro_batch_bytes,
                "per_micro_batch_s": self.per_micro_batch_s}


def tp_comm(spec: ModelSpec, training: TrainingSpec, timer: CommTimer | None, degree: int) -> TPComm:
    """The TP all-reduces of one micro-batch of the whole model ``spec`` at ``degree``
    (``timer`` None: bytes only, their seconds 0)."""
    tokens = training.tokens_per_micro_batch
    act = tokens * spec.hidden_size * param_bytes(training.precision)
    seconds = timer.time("allreduce", act, degree, 1) if timer is not None else 0.0
    return TPComm(degree=degree, num_layers=spec.num_layers, recompute=training.recompute,
                  activation_bytes=act, activation_s=seconds)
