"""``amsp dryrun``: one rank of a huge world in one CPU process, the real engine on fake tensors.

    from amsp_ext.tools.dryrun import DryRunSpec, dry_run
    result = dry_run(DryRunSpec(model="llama-7b", num_nodes=128, gpus_per_node=8, plan="zero3"))

[Note: dry run]
Each sampled rank runs in a subprocess of its own (:func:`run_rank`, at most two at once):
``init_process_group("fake", FakeStore(), rank=r, world_size=R)`` (every collective returns at
once and moves no data), then under ``FakeTensorMode`` (tensors with shapes, dtypes, devices and
no storage) the model is built on ``meta`` and ``amsp_ext.shard`` gives each rank its share
([Note: start-up]) and applies the plan exactly as a real run does (same groups, buckets, ownership),
and ``steps`` full steps run (M micro-batches forward/backward, clip, optimizer step, the
post-step broadcasts). Every collective runtime/collectives.py issues is logged by an observer
of the collective context ``run_rank`` hands to ``shard`` (kind, group size, cross-node, bytes
as the planner counts them, phase), and
torch's ``MemTracker`` counts the step's memory by category.

[Note: categories at the peak]
``--steps 2`` (the default) measures the last step: the memory tracker's peak restarts there
(``reset_peak``), so the optimizer's fp32 masters and Adam moments, created by the first step,
are alive through the measured one. MemTracker files a tensor by where it was allocated; the
engine's gradients (buckets' owned results, kept Tg gradients, FSDP2's sharded ``.grad``) are
allocated in backward, where it would call them ``Temp``: ``grad_sync.grad_tensors()`` are
re-filed as ``Grad`` whenever a new peak is about to be recorded. A gradient made by the very
op that sets the peak is filed once it is stored, so at the peak the unit being reduced may
show as ``Temp``. Parameters FSDP2 gathers whole are temporary buffers, as the planner counts
them (``gathered_params``); MemTracker would file them as ``Parameter`` or, when a forward or a
recomputation gathers them, ``Activation``: they are re-filed as ``Temp`` the same way. The
tensors DTensor makes to propagate shapes are not counted (``_torch_compat.mem_tracker``).
With M = 1 the peak is usually in the loss's backward (activations largest,
no gradient yet), so ``grads`` at the peak is ~0 there, as the planner's [Note: gradients at
M = 1] says; ``model_state_bytes`` (after the step) is the engine's full count. Each rank also
reports the moment of the step its peak is at (:class:`PeakMoment`): the planner's activations
and temporary buffers differ by moment (planner/memory.py [Note: temporary buffers and the
peak]), so the report sets the engine's categories beside the planner's at the same moment.

What a fake run cannot be, and how it is handled:
* host reads of tensor values (``float(norm)`` in clipping, the non-finite guard's verdict)
  have no value: ``_torch_compat.nominal_fake_scalars`` makes them return a nominal finite value (1.0, 0,
  False), so control flow takes the ordinary "finite, no skip" path of a healthy step;
* the fake backend's all-gather of fingerprints returns no data: collectives.all_gather_bytes
  answers with this rank's payload on the fake backend (every simulated rank runs this code);
* the device is ``cpu`` by default (fake CPU tensors): FSDP2 on a ``cuda`` mesh needs CUDA
  streams and events, which cannot be faked on a CPU-only build, and FSDP2 moves its states to
  the mesh's device. Memory is counted per tensor, so the figures do not depend on the device;
  the CUDA branches of the engine (streams, events, device placement) run only with
  ``device="cuda"`` on a machine with a GPU ([Note: real tensors on a GPU]; run there with real
  tensors only: fake tensors on a GPU have not run).

[Note: start-up]
The model is built on ``meta`` and ``shard()`` makes it real (runtime/materialize.py): each
rank allocates its share and runs the model's initializer module by module. A second tracker
follows ``shard()`` from the meta model to the sharded one: ``startup_peak_bytes`` is its peak
(the local parameters, the owners' fp32 masters, and one module's parameters built whole in
fp32 for the initializer), beside the step's ``peak_bytes``.

[Note: frozen models in a dry run]
``frozen_models=N`` (``amsp dryrun --frozen-models N``) runs a post-training job's frozen
companions (a DPO / GRPO reference, a same-size reward model) beside the trained model, as the
planner prices them (planner/specs.py [Note: frozen models]): N more copies of the model, built
on meta and sharded by the same plan with no optimizer (forward-only engines: their p shards,
no gradient, master or optimizer state), each run on every micro-batch under no_grad before
the trained model's step, as DPO scores its batch with the reference. Their shards and the
units they gather are in the tracked memory beside the trained model's; their all-gathers are
in the step's collectives. The planner's side is the same job with ``frozen_models=N``.

[Note: real tensors on a GPU]
``tensors="real", device="cuda"`` runs the sampled rank with allocated tensors on this
machine's GPU, still on the fake backend. The model is built on meta and initialised for real
by ``shard()`` (seed 0),
the engine takes the GPU as an NCCL rank would (runtime/engine.py ``engine_device``: its side
streams, events and ``record_stream``), and the step's compute is a real rank's. What the fake
run cannot see, this one measures: the CUDA caching allocator's peak (``max_memory_allocated``,
``max_memory_reserved``: blocks a side stream still holds, fragmentation) beside MemTracker's
count and the planner's, and the step time without communication (one more step, outside the
tracker, whose dispatch hooks slow every op; the allocator's peak is read after it, so it
covers the last tracked step and that one). The fake backend of torch 2.11 and 2.13 fills an
all-gather's output with copies of this rank's input and a reduce-scatter's with its own chunk,
so values stay finite and the step takes the ordinary path; ``fake_fills_outputs`` says whether
this torch does (where it does not, outputs hold stale memory and a non-finite verdict may skip
a step: ``steps_skipped``). Filling costs one copy per rank of the group, so at 1,024 ranks a
ZeRO-3 step's time is mostly the simulation's (comparisons/results/design_history.md, "Memory reserve slack").
One rank runs at a time (the GPU is shared). ``tensors="real"`` on ``cpu`` is the same run on
the CPU (the tests' check of this path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from amsp_ext import schema
from amsp_ext.choices import DRYRUN_DEVICES, DRYRUN_OPTIMIZERS, DRYRUN_TENSORS, MISSING_MESH, check_int, check_one_of
from amsp_ext.engine_config import EngineConfig
from amsp_ext.planner.defaults import DEFAULT_GPU_MEMORY_BYTES, DEFAULT_MISSING_MESH, DEFAULT_PROFILE
from amsp_ext.planner.specs import StepShape

__all__ = ["CollectiveLog", "DryRunSpec", "PeakMoment", "TPLog", "build_model", "collective_counts", "dry_step",
           "dry_run", "memory_categories",
           "dry_run_many", "planner_numbers", "run_rank", "hf_config_of"]

@dataclass(frozen=True, kw_only=True)
class DryRunSpec(StepShape):
    """What ``amsp dryrun`` runs: the step's shape (StepShape) of a job on the world below.
    ``ranks`` None: rank 0, one rank of a middle node, the last."""

    model: str | None = "tiny-llama"
    model_config: str | None = None
    num_nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_bytes: int = DEFAULT_GPU_MEMORY_BYTES
    plan: str = "zero3"
    engine: EngineConfig = field(default_factory=EngineConfig)  # the engine's settings, as a real run's
    steps: int = 2
    ranks: tuple[int, ...] | None = None
    profile: str = DEFAULT_PROFILE
    missing_mesh: str = DEFAULT_MISSING_MESH  # --plan auto: a mesh the profile lacks (error | fit)
    tensors: str = "fake"  # [Note: real tensors on a GPU]
    device: str = "cpu"
    optimizer: str = "adamw"  # muon, adafactor: whole-tensor (runtime/optim/whole_tensor.py)
    # [Note: frozen models in a dry run]: forward-only copies of the model beside the trained one
    frozen_models: int = 0

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:
            raise ValueError(f"dryrun: {e}") from None
        for name in ("num_nodes", "gpus_per_node", "steps", "gpu_memory_bytes"):
            check_int(getattr(self, name), f"dryrun: {name}", minimum=1)
        check_int(self.frozen_models, "dryrun: frozen_models", minimum=0)
        check_one_of(self.missing_mesh, MISSING_MESH, "dryrun: missing_mesh")
        check_one_of(self.tensors, DRYRUN_TENSORS, "dryrun: tensors")
        check_one_of(self.device, DRYRUN_DEVICES, "dryrun: device")
        check_one_of(self.optimizer, DRYRUN_OPTIMIZERS, "dryrun: optimizer")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"dryrun: engine must be an EngineConfig, got {type(self.engine).__name__}")
        world = self.world
        for r in self.ranks or ():
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise ValueError(f"dryrun: --ranks: rank {r!r} is out of range 0..{world - 1} "
                                 f"(world {self.num_nodes} x {self.gpus_per_node})")

    # the engine settings the dry run's own accounting reads (one definition: EngineConfig)
    tensor_parallel = property(lambda self: self.engine.tensor_parallel)
    precision = property(lambda self: self.engine.precision)
    reduce_dtype = property(lambda self: self.engine.reduce_dtype)
    recompute = property(lambda self: self.engine.recompute)
    granularity = property(lambda self: self.engine.granularity)
    bucket_bytes = property(lambda self: self.engine.grad_bucket_bytes)

    @property
    def world(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def dp_gpus_per_node(self) -> int:
        """Data-parallel ranks per node: the plan's s0 divide this (planner/tensor_parallel.py)."""
        return self.gpus_per_node // self.tensor_parallel

    def sampled_ranks(self) -> tuple[int, ...]:
        if self.ranks:
            return tuple(dict.fromkeys(self.ranks))
        middle = (self.num_nodes // 2) * self.gpus_per_node + self.gpus_per_node // 2
        return tuple(dict.fromkeys((0, min(middle, self.world - 1), self.world - 1)))


# -- checks before any process starts --------------------------------------------------------
def model_spec_of(spec: DryRunSpec):
    """The whole model's spec; a T that does not divide its heads is one line here."""
    from amsp_ext.common.models import model_spec
    from amsp_ext.planner.tensor_parallel import check_tensor_parallel

    ms = model_spec(spec.model, spec.model_config)
    check_tensor_parallel(spec.tensor_parallel, ms, spec.gpus_per_node)
    return ms


def resolved(spec: DryRunSpec):
    """``(plan, spec)``: the plan (named, explicit or ``auto``) validated for the world, and
    ``spec`` with its engine's all-reduce mode decided for it, by the resolver every route uses
    (amsp_ext/job.py; the ranks run with no planner inputs). One-line ValueError."""
    from amsp_ext.job import resolve

    planned = resolve(job_of(spec))  # reads no profile unless it has to price
    engine = dataclasses.replace(spec.engine, all_reduce=planned.all_reduce.mode)
    return planned.plan, dataclasses.replace(spec, engine=engine)


def _training(spec: DryRunSpec):
    """The planner's TrainingSpec of the dry run's job, with the engine's settings
    (training_spec: the reduce dtype too, so both sides count the same gradient bytes)."""
    from amsp_ext.engine_config import training_spec
    from amsp_ext.planner.defaults import DEFAULT_ALL_REDUCE

    # the memory model and the bytes below do not read the all-reduce mode, which may be "auto"
    return training_spec(spec.engine, spec, all_reduce=DEFAULT_ALL_REDUCE, optimizer=spec.optimizer,
                         frozen_models=spec.frozen_models)


def job_of(spec: DryRunSpec):
    """The dry run's job (amsp_ext/job.py): the model's spec, the world, the engine's settings
    with the step shape and the planner inputs, and the plan request."""
    from amsp_ext.job import Job
    from amsp_ext.planner.auto import AutoPlanConfig

    auto = AutoPlanConfig(**vars(spec.shape()), profile=spec.profile,
                          missing=spec.missing_mesh, gpu_memory_bytes=spec.gpu_memory_bytes,
                          optimizer=spec.optimizer, frozen_models=spec.frozen_models)
    engine = dataclasses.replace(spec.engine, gpus_per_node=spec.gpus_per_node, auto=auto)
    return Job(model=model_spec_of(spec), num_nodes=spec.num_nodes, engine=engine, plan=spec.plan)


def planner_numbers(spec: DryRunSpec, plan) -> dict:
    """The planner's memory per category (planner/memory.py) and the bytes per rank per step of
    each collective kind that its Tp, Tg, T0_os and T1_os charge (planner/cost.py's arguments).
    Under TP T the job is AMSP's over the data-parallel world on one TP rank's shard
    (planner/tensor_parallel.py [Note: a TP job is an AMSP job of TP shards]), plus the TP
    all-reduces of ``tensor_parallel``: per layer 2 in forward and 2 in backward of b x s x h
    compute-dtype bytes each (2 more with recompute), none outside the layers."""
    from amsp_ext.planner.issued import unit_gathers
    from amsp_ext.planner.memory import grad_bytes, memory_breakdown, param_bytes, whole_tensor_rows
    from amsp_ext.planner.tensor_parallel import tp_shard_spec

    whole, training, T = model_spec_of(spec), _training(spec), spec.tensor_parallel
    ms, R = tp_shard_spec(whole, T), spec.dp_gpus_per_node
    mem = memory_breakdown(ms, plan, training, gpus_per_node=R, num_nodes=spec.num_nodes)
    phi, M = ms.num_params, spec.num_micro_batches
    e, e_g = param_bytes(spec.precision), grad_bytes(training)
    size = lambda m: m[0] * m[1]  # noqa: E731
    fwd, bwd, _ = unit_gathers(ms, spec.granularity)  # the root unit is not gathered in backward
    # Tp's gathers, and each frozen model's forward ones ([Note: frozen models in a dry run])
    ag = M * e * int(sum(fwd) + sum(bwd) + spec.frozen_models * sum(fwd)) if size(plan.mesh("p")) > 1 else 0
    rs = M * e_g * phi if size(plan.mesh("p")) > 1 else 0          # Tp: one reduce-scatter
    ar = 0
    if size(plan.grad_mesh()) > 1:
        ar += (M - 1) * e_g * phi // plan.sp                        # Tg
    if size(plan.replica_mesh(R, spec.num_nodes)) > 1:
        ar += e_g * phi // plan.sp                                  # T0_os
    bc = e * phi // plan.sp if size(plan.bcast_mesh()) > 1 else 0   # T1_os
    # Twt (cost.py [Note: the whole-tensor exchange]): a rank's two all-to-alls, on average
    a2a = 2 * 4 * phi // plan.sos if whole_tensor_rows(training, plan) else 0
    return {"collectives": collective_counts(ms, plan, spec), "memory": {"params": mem.params, "grads": mem.grads, "optimizer": mem.optim,
                       "activations": mem.activations, "temporary": mem.tmp, "total": mem.total,
                       "step_total": mem.step_total, "startup": mem.startup},
            "peak_moment": mem.tmp_parts["peak_phase"],
            "moments": {m: {"activations": v["activations"], "temporary": v["tmp"]}
                        for m, v in mem.moments.items()},
            "bytes": {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "broadcast": bc, "all_to_all": a2a},
            "tensor_parallel": _tp_bytes(whole, training, T, M)}


def collective_counts(ms, plan, spec: DryRunSpec) -> dict:
    """Per step: the all-gathers and reduce-scatters of ``param_shard`` and the gradient
    all-reduces of ``param_replica`` the planner prices (the engine's units and buckets,
    planner/issued.py), and what FSDP2's ZeRO-3 of the same sharding would issue, wrapped the
    usual way (issued.py [Note: FSDP2's count]): fully sharded over the plan's p group, HSDP
    (one all-reduce per group per micro-batch) when that group is replicated. AMSP reduces
    across replicas once per step, at the boundary (grad_sync.py [Note: three modes of a
    backward pass])."""
    from amsp_ext.planner.issued import (
        collectives_per_micro_batch,
        forward_gathers,
        fsdp2_collectives_per_micro_batch,
        grad_buckets,
    )
    from amsp_ext.planner.memory import grad_bytes

    M = spec.num_micro_batches
    if plan.sp == 1:
        return {"planner": {}, "fsdp2": {}}
    hsdp = plan.sp < spec.world // spec.tensor_parallel
    ours = collectives_per_micro_batch(ms, spec.granularity)
    fsdp2 = fsdp2_collectives_per_micro_batch(ms.num_layers, hsdp=hsdp)
    # a frozen model gathers each unit once in its forward: the root and every layer's (FSDP2:
    # the L + 1 groups), and reduces nothing ([Note: frozen models in a dry run])
    ours["all_gather"] += spec.frozen_models * forward_gathers(ms, spec.granularity)
    fsdp2["all_gather"] += spec.frozen_models * (ms.num_layers + 1)
    planner = {k: M * n for k, n in ours.items()}
    replica = plan.replica_mesh(spec.dp_gpus_per_node, spec.num_nodes)
    if replica[0] * replica[1] > 1:
        training = _training(spec)
        planner["all_reduce"] = len(grad_buckets(ms, plan, granularity=spec.granularity,
                                                 bucket_bytes=training.bucket_bytes,
                                                 elem_bytes=grad_bytes(training)))
    return {"planner": planner, "fsdp2": {k: M * n for k, n in fsdp2.items()}}


def _tp_bytes(whole, training, T: int, M: int) -> dict:
    """The TP all-reduce bytes the planner prices (tensor_parallel.tp_comm, bytes only): one
    activation all-reduce, one layer's per micro-batch, and one step's by phase."""
    from amsp_ext.planner.tensor_parallel import tp_comm

    tp = tp_comm(whole, training, None, T)
    forward = M * whole.num_layers * tp.layer_forward * tp.activation_bytes
    return {"degree": T, "activation_allreduce_bytes": tp.activation_bytes if T > 1 else 0,
            "layer_bytes_per_micro_batch": tp.layer_bytes,
            # the recomputation's all-reduces run inside the backward pass
            "step_bytes": {"forward": forward, "backward": M * tp.per_micro_batch_bytes - forward},
            "step_total_bytes": M * tp.per_micro_batch_bytes}


# -- the launcher ----------------------------------------------------------------------------
def dry_run(spec: DryRunSpec, *, max_parallel: int = 2, timeout_s: float | None = None) -> dict:
    """Check everything, then run each sampled rank in its own process; one JSON-able result."""
    return dry_run_many([spec], max_parallel=max_parallel, timeout_s=timeout_s)[0]


def dry_run_many(specs: list[DryRunSpec], *, max_parallel: int = 2,
                 timeout_s: float | None = None) -> list[dict]:
    """:func:`dry_run` of several specs (plans, shapes) with their rank processes sharing one
    pool of ``max_parallel``: every spec is checked before any process starts, and the pool
    stays full across specs (most of a small rank's time is its interpreter's imports)."""
    checked = []
    if any(spec.device == "cuda" for spec in specs):
        _check_gpu()
        max_parallel = 1  # one GPU: ranks would share its memory and its time
    for spec in specs:
        model_spec_of(spec)  # unknown model: one line, before any process
        plan, spec = resolved(spec)
        checked.append((spec, plan, planner_numbers(spec, plan)))
    t0 = time.perf_counter()
    todo = [(i, r) for i, (spec, _, _) in enumerate(checked) for r in spec.sampled_ranks()]
    running, results = [], {}
    while todo or running:
        while todo and len(running) < max_parallel:
            i, r = todo.pop(0)
            spec, plan, _ = checked[i]
            payload = json.dumps({**asdict(spec), "plan": str(plan), "ranks": None})
            p = subprocess.Popen([sys.executable, "-m", "amsp_ext.tools.dryrun", str(r), payload],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, "AMSP_DRYRUN": "1"})
            running.append((i, r, p, time.perf_counter()))
        i, r, p, started = running.pop(0)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in (p, *(q for _, _, q, _ in running)):
                q.kill()
            raise RuntimeError(f"dryrun: {checked[i][1]} rank {r} did not finish within "
                               f"{timeout_s} s") from None
        if p.returncode != 0:
            for _, _, q, _ in running:
                q.kill()
            last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise RuntimeError(f"dryrun: {checked[i][1]} rank {r} failed (exit {p.returncode}): {last[0]}")
        rec = json.loads(out.strip().splitlines()[-1])
        rec["wall_s"] = time.perf_counter() - started
        results[i, r] = rec
    seconds = time.perf_counter() - t0
    return [_result(spec, plan, planner, [results[i, r] for r in spec.sampled_ranks()], seconds)
            for i, (spec, plan, planner) in enumerate(checked)]


def _check_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"dryrun: device 'cuda' needs a GPU, and torch {torch.__version__} sees none; "
                         f"use device 'cpu' (allowed: {', '.join(DRYRUN_DEVICES)})")


def _result(spec: DryRunSpec, plan, planner: dict, ranks: list[dict], seconds: float) -> dict:
    fits = all(max(rec["peak_bytes"], rec["startup_peak_bytes"]) <= spec.gpu_memory_bytes for rec in ranks)
    return {"world": spec.world, "plan": str(plan), "model": spec.model or spec.model_config,
            "shape": {"seq_len": spec.seq_len, "micro_batch_size": spec.micro_batch_size,
                      "micro_batches": spec.num_micro_batches, "precision": spec.precision,
                      "reduce_dtype": spec.reduce_dtype, "recompute": spec.recompute},
            "tensors": spec.tensors, "device": spec.device, "ranks": ranks, "planner": planner, "fits": fits,
            "gpu_memory_bytes": spec.gpu_memory_bytes, "seconds": seconds}


# -- one rank (runs in its own process) -------------------------------------------------------
def hf_config_of(spec: DryRunSpec) -> dict:
    """A Llama ``config.json`` dict for the model (built-ins, presets, or --model-config)."""
    from amsp_ext.common.models import MODEL_CONFIGS, llama_config_dict

    if spec.model in MODEL_CONFIGS:
        return llama_config_dict(spec.model)
    if spec.model_config is not None:
        with open(spec.model_config) as f:
            return json.load(f)
    ms = model_spec_of(spec)
    return {"vocab_size": ms.vocab_size, "hidden_size": ms.hidden_size,
            "intermediate_size": ms.intermediate_size, "num_hidden_layers": ms.num_layers,
            "num_attention_heads": ms.num_heads, "num_key_value_heads": ms.num_kv_heads,
            "head_dim": ms.head_dim, "tie_word_embeddings": ms.tie_word_embeddings,
            "attention_bias": ms.qkv_bias, "mlp_bias": ms.mlp_bias,
            "max_position_embeddings": max(4096, spec.seq_len), "rms_norm_eps": 1e-5}


def build_model(spec: DryRunSpec, device=None, *, on_meta: bool = True):
    """The Llama model on ``meta``, which the dry run shards (shard() allocates each rank's share
    and initialises it, [Note: start-up]); ``on_meta=False``: built and initialised on ``device``
    (seconds for 7B on a GPU), for a caller that shards it by other means."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in hf_config_of(spec).items() if k not in ("architectures",)}
    config = LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"  # what a GPU run uses: the fused kernel, no s x s matrix
    if not on_meta:
        torch.manual_seed(0)
    with torch.device("meta" if on_meta else device):
        return LlamaForCausalLM(config)


def fake_fills_outputs() -> bool:
    """Whether this torch's fake backend writes an all-gather's output (2.11 and 2.13 do: copies
    of the input); with real tensors, unwritten outputs would hold stale memory. A throwaway context:
    the probe is not one of the engine's collectives."""
    import torch
    import torch.distributed as dist

    from amsp_ext.runtime import collectives as C

    out = torch.full((2 * dist.get_world_size(),), float("nan"))
    C.all_gather_into_tensor(C.CollectiveContext(timeout=60), out, torch.ones(2), None, name="world",
                             stream=None, async_op=False)
    return bool(torch.isfinite(out).all())


def _sdpa_kernel(model, spec: DryRunSpec, device) -> str:
    """Which fused SDPA kernel torch would pick on a GPU for this attention's shape and dtype."""
    import torch

    from amsp_ext.runtime.config import PRECISIONS

    dtype = PRECISIONS[spec.precision]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flash_ok = dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256
    return ("flash (aten._scaled_dot_product_flash_attention, by shape/dtype; the fake CPU run "
            "dispatched aten.scaled_dot_product_attention)" if flash_ok else
            "efficient or math (dtype/head_dim exclude flash)")


class CollectiveLog:
    """An observer of the run's collective context (collectives.py [Note: observer]): one
    record per issued collective (kind, group kind, group size, cross-node, bytes as the planner
    counts them, phase). ``phase`` is set by the loop."""

    def __init__(self, *, world: int, gpus_per_node: int) -> None:
        self.world, self.R = world, gpus_per_node
        self.phase, self.records, self._sizes = "setup", [], {}

    def __call__(self, event, op, name, info) -> None:
        if event != "issued":
            return
        if name not in self._sizes:  # PlanMesh.name lists this rank's group: "param_shard[8,9,...]"
            if "[" in name:
                ranks = [int(x) for x in name.split("[", 1)[1].rstrip("]").split(",") if x]
            else:  # "world"
                ranks = range(self.world)
            self._sizes[name] = (len(ranks), len({r // self.R for r in ranks}) > 1)
        n, cross = self._sizes[name]
        self.records.append({"kind": op, "group": name.split("[", 1)[0], "group_size": n,
                             "cross_node": cross, "bytes": int(getattr(info, "nbytes", 0)),
                             "phase": self.phase})


class TPLog:
    """The TP collectives of a step: DTensor issues them through torch's functional collectives
    (``_c10d_functional``), not through runtime/collectives.py, so the collective log cannot see
    them; a dispatch observer (``compat.op_observer``) records each one under the loop's phase,
    apart from AMSP's traffic. Only the ops of ``record`` steps are kept."""

    KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}

    def __init__(self, clog: CollectiveLog) -> None:
        self.clog, self.records, self.on = clog, [], False

    def __call__(self, op_name: str, args) -> None:
        ns, _, name = op_name.partition("::")
        if not self.on or ns != "_c10d_functional" or name not in self.KINDS:
            return
        t = args[0]
        self.records.append({"kind": self.KINDS[name], "group": "tp", "phase": self.clog.phase,
                             "bytes": int(t.numel() * t.element_size())})


class PeakMoment:
    """Which moment of the step (planner/memory.py [Note: temporary buffers and the peak]) the
    memory tracker's latest peak is at: ``forward``, ``loss backward`` (backward outside every
    decoder layer: the loss and the head), ``layer backward`` or ``optimizer step`` (the clip,
    the step and the post-step broadcasts, by the collective log's phase)."""

    def __init__(self, clog: CollectiveLog) -> None:
        self.clog, self.name = clog, None

    def __call__(self, parents: set, is_bw: bool) -> None:
        if self.clog.phase == "optimizer":
            self.name = "optimizer step"
        elif not is_bw:
            self.name = "forward"
        else:
            in_layer = any(".layers." in p for p in parents)
            self.name = "layer backward" if in_layer else "loss backward"


def dry_step(model, opt, spec: DryRunSpec, device, clog: CollectiveLog, *, frozen=()) -> None:
    """One step as ``amsp train`` runs it (runtime/step.py ``train_step``, clip 1.0) on zero
    tokens, each collective logged under its phase; then the post-step broadcasts waited for.
    ``frozen``: forward-only models, each run on every micro-batch first under no_grad, as
    DPO scores its batch with the reference ([Note: frozen models in a dry run])."""
    import contextlib

    import torch

    from amsp_ext.common.models import causal_lm_loss
    from amsp_ext.runtime.step import train_step

    @contextlib.contextmanager
    def logged(name: str):
        clog.phase = name  # the post-step broadcasts are issued inside step(): "optimizer"
        yield

    batches = [torch.zeros(spec.micro_batch_size, spec.seq_len + 1, dtype=torch.long, device=device)
               for _ in range(spec.num_micro_batches)]
    with logged("forward"), torch.no_grad():
        for ref in frozen:
            for batch in batches:
                causal_lm_loss(ref, batch)
    train_step(model, opt, batches, causal_lm_loss, clip=1.0, phase=logged)
    model.amsp.wait_params()


def run_rank(spec: DryRunSpec, rank: int) -> dict:
    """Dry-run ``rank`` of ``spec.world`` in this process (see [Note: dry run])."""
    import contextlib

    import torch
    import torch.distributed as dist

    from amsp_ext.runtime import _torch_compat as compat
    from amsp_ext.runtime import collectives as C
    from amsp_ext.runtime.tensor_parallel import parallelize_llama

    t0 = time.perf_counter()
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=spec.world)
    tp_mesh = _tp_mesh(spec)  # before fake mode: the mesh's rank tables are real host data
    clog = CollectiveLog(world=spec.world, gpus_per_node=spec.gpus_per_node)
    tplog = TPLog(clog)
    comm = C.CollectiveContext(timeout=spec.engine.timeout, observers=[clog])  # from shard's first one
    real, cuda = spec.tensors == "real", spec.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = dataclasses.replace(spec.engine, gpus_per_node=spec.gpus_per_node)
    mem: dict = {}
    fills = fake_fills_outputs() if real else None
    step_s: list[float] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with (contextlib.nullcontext() if real else compat.fake_tensor_mode()), \
            (contextlib.nullcontext() if real else compat.nominal_fake_scalars()), \
            (contextlib.nullcontext() if real else compat.real_device_meshes()):
        model = build_model(spec)
        if tp_mesh is not None:  # on meta: shapes only; shard() fills each rank's block
            parallelize_llama(model, tp_mesh)
        t_build = time.perf_counter()
        model, opt, startup_mem, startup_allocated = _start(model, spec, config, comm, device)
        frozen = [_start_frozen(spec, config, comm, device) for _ in range(spec.frozen_models)]
        t_shard = time.perf_counter()
        moment = PeakMoment(clog)
        tracker = compat.mem_tracker(grads_of=model.amsp.grad_sync.grad_tensors,
                                     gathered_of=_gathered_of(model, frozen), on_new_peak=moment)
        tracker.track_external(model, opt, *frozen)
        with tracker, compat.op_observer(tplog):
            tplog.on = True
            for step in range(spec.steps):
                if step == spec.steps - 1:  # [Note: categories at the peak]: the last step only
                    tracker.reset_mod_stats()
                    tracker.reset_peak()
                    moment.name = None
                    tplog.records.clear()  # the measured step's TP collectives only
                    if cuda:
                        sync()
                        torch.cuda.reset_peak_memory_stats()
                t_step = time.perf_counter()
                dry_step(model, opt, spec, device, clog, frozen=frozen)
                sync()
                step_s.append(time.perf_counter() - t_step)
            tplog.on = False
        state_bytes = model.model_state_bytes()  # after a step: gradients and states exist
        peak = tracker.get_tracker_snapshot("peak")
        mem = memory_categories(peak)
        if real:  # one more step outside the tracker: its dispatch hooks slow every op
            t_step = time.perf_counter()
            dry_step(model, opt, spec, device, clog, frozen=frozen)
            sync()
            untracked_s = time.perf_counter() - t_step
    t_end = time.perf_counter()
    steps = spec.steps + (1 if real else 0)  # the untracked step's collectives are logged too
    log = clog.records
    last = [c for c in log if c["phase"] != "setup"]
    per_step = len(last) // steps if steps else 0
    rec = {"rank": rank, "peak_bytes": mem.pop("_total"), "memory": mem, "peak_moment": moment.name,
           "startup_peak_bytes": startup_mem.pop("_total"), "startup_memory": startup_mem,
           "model_state_bytes": state_bytes, "collectives": last[-per_step:] if per_step else [],
           "setup_collectives": [c for c in log if c["phase"] == "setup"],
           "tp_collectives": tplog.records,
           "sdpa_kernel": _sdpa_kernel(model, spec, device),
           "seconds": {"build": t_build - t0, "shard": t_shard - t_build, "steps": t_end - t_shard,
                       "total": t_end - t0}}
    if real:  # [Note: real tensors on a GPU]
        rec["real"] = _real_record(fills=fills, step_s=step_s, untracked_s=untracked_s, opt=opt,
                                   device=device, startup_allocated=startup_allocated)
    return rec


def _tp_mesh(spec: DryRunSpec):
    """The ``tp`` dimension of torchtitan's (dp, tp) mesh under T > 1; None without TP."""
    if spec.tensor_parallel == 1:
        return None
    from amsp_ext.runtime.tensor_parallel import tensor_parallel_mesh

    return tensor_parallel_mesh(spec.tensor_parallel, spec.device)["tp"]


def _real_record(*, fills, step_s, untracked_s, opt, device, startup_allocated) -> dict:
    """What a run on allocated tensors measured beyond the fake run ([Note: real tensors on a GPU])."""
    import torch

    out = {"torch": torch.__version__, "fake_fills_outputs": fills, "step_s": step_s,
           "untracked_step_s": untracked_s, "steps_skipped": opt.skipped_steps}
    if device.type == "cuda":
        out.update(device=torch.cuda.get_device_name(device), startup_peak_allocated_bytes=startup_allocated,
                   peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                   allocated_after_step_bytes=torch.cuda.memory_allocated(device))
    return out


def _start(model, spec: DryRunSpec, config, comm, device):
    """``shard()`` of the meta model under a tracker of its own ([Note: start-up]): the sharded
    model, its optimizer, the start-up peak by category and (on a GPU) the allocator's peak."""
    import torch

    from amsp_ext.runtime import _torch_compat as compat
    from amsp_ext.runtime.shard import shard

    startup = compat.mem_tracker()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with startup, torch.device(device):
        model, opt = shard(model, spec.plan, _optimizer_factory(spec.optimizer), config=config, comm=comm)
    allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return model, opt, memory_categories(startup.get_tracker_snapshot("peak")), allocated


def _start_frozen(spec: DryRunSpec, config, comm, device):
    """A frozen model beside the trained one: the same shape built on meta and sharded by the
    same plan with no optimizer (a forward-only engine: its p shards only)."""
    import torch

    from amsp_ext.runtime.shard import shard

    with torch.device(device):
        ref, _ = shard(build_model(spec), spec.plan, None, config=config, comm=comm)
    return ref


def _gathered_of(model, frozen):
    """The parameters FSDP2 gathered whole, of the trained model and of the frozen ones (the
    tracker files them as temporary buffers, [Note: categories at the peak])."""
    from amsp_ext.runtime import _torch_compat as compat

    of = [compat.fsdp_unsharded_tensors(m) for m in (model, *frozen)]
    return lambda: [t for f in of for t in f()]


def _optimizer_factory(name: str):
    """The optimizer a dry run steps: AdamW, Muon for the hidden matrices with AdamW for the rest
    (DeepSpeed's "Muon"), or torch's Adafactor."""
    import torch

    from amsp_ext.runtime.optim.muon_adamw import muon_adamw_factory

    if name == "muon":
        return muon_adamw_factory()
    if name == "adafactor":
        return lambda ps: torch.optim.Adafactor(ps, lr=1e-2)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-4)


def memory_categories(peak: dict) -> dict:
    """MemTracker's peak snapshot (device -> reference type -> bytes) as our five categories."""
    out = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "temporary": 0, "_total": 0}
    for dev, by_type in peak.items():
        if str(dev) == "meta":  # MemTracker files a model built on meta too: no bytes behind it
            continue
        for ref, n in by_type.items():
            name = str(getattr(ref, "value", ref)).lower()
            if name == "total":
                out["_total"] += n
            elif "param" in name:
                out["params"] += n
            elif "grad" in name:
                out["grads"] += n
            elif "opt" in name:
                out["optimizer"] += n
            elif "act" in name:
                out["activations"] += n
            else:
                out["temporary"] += n
    return out


def _main(argv: list[str]) -> int:
    spec_d = json.loads(argv[1])
    spec_d["ranks"] = None
    spec_d["engine"] = schema.from_dict(EngineConfig, spec_d["engine"], where="engine")
    spec = DryRunSpec(**spec_d)
    rec = run_rank(spec, int(argv[0]))
    sys.stdout.write(json.dumps(rec) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the fake groups' teardown is not worth waiting for


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
