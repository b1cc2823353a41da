"""Tensor parallelism inside the node, AMSP over the data-parallel ranks: the checks ``shard``
runs on a tensor-parallel model before any collective, and the standard Llama TP layout
``amsp train --tensor-parallel T`` applies.

[Note: how the engine learns T]
The user says T once, in ``ShardConfig(tensor_parallel=T)`` (``amsp train --tensor-parallel T``),
and hands ``shard`` a model already made tensor-parallel on the ``tp`` dimension of a 2-D
DeviceMesh (``parallelize_module``, as torchtitan applies it; ``parallelize_llama`` below is the
standard layout). The engine does not guess T from the parameters: a model whose DTensors do not
match the config is refused with one line, before any collective, either way round
(``check_tensor_parallel``). The layout is torchtitan's ``("dp", "tp")`` mesh: the T ranks of a
TP group are consecutive global ranks inside one node (topology/groups.py [Note: the
data-parallel world of a 2-D mesh]); the check compares the DTensors' mesh with that. Every plan
of the data-parallel world runs: with sp = 1 the TP shards are the engine's local tensors; with
sp > 1 FSDP2 shards them further ([Note: FSDP2's mesh under TP]).

[Note: TP shards and replicated parameters]
AMSP treats each rank's local TP shard as its parameter: ``to_local()`` of a ``Shard``-placed
DTensor is sharded, reduced and stepped over the data-parallel ranks of its TP coordinate only.
Parameters outside the TP plan (norms, embedding, lm_head in ``parallelize_llama``) are plain
tensors, whole and equal on every TP rank: their gradients are equal too, since every input
they see is the output of a TP all-reduce (bit for bit where that all-reduce hands every rank the
same sum, as gloo's and NCCL's do; the engine does not re-synchronise these copies, as
torchtitan's FSDP2 + TP does not). So a global gradient norm sums each TP shard's
squares once over the TP group, but a replicated parameter's T times: its squares are divided by
T (``LocalTensor.tp_replicas``). Parameters placed ``Replicate`` on the TP mesh (sequence
parallel norms) would get ``Partial`` gradients, which the engine does not reduce over TP: they
are refused.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from amsp_ext.planner.plan import Plan
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.topology.groups import World, axis_sizes, node_order

__all__ = ["check_llama_layout", "check_tensor_parallel", "check_tp_plan", "data_parallel_mesh", "parallelize_llama", "tensor_parallel_mesh",
           "tp_sharded_names"]


def tp_sharded_names(model: nn.Module) -> set[str]:
    """Names of the parameters sharded over TP (before FSDP2 makes every parameter a DTensor)."""
    return {n for n, p in model.named_parameters() if isinstance(p, DTensor)}


def check_tensor_parallel(model: nn.Module, world: World, *, adaptive) -> None:
    """[Note: how the engine learns T]: one-line ValueErrors, before any collective."""
    T = world.tensor_parallel
    dtensors = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if T == 1:
        if dtensors:
            raise ValueError(
                f"amsp_ext.shard: parameter {dtensors[0][0]} is a DTensor (the model is already tensor-"
                f"parallel or sharded); for a tensor-parallel model set ShardConfig(tensor_parallel=T) to "
                f"its TP degree T")
        return
    if not dtensors:
        raise ValueError(
            f"amsp_ext.shard: config.tensor_parallel={T} but the model has no tensor-parallel (DTensor) "
            f"parameter: apply parallelize_module on the tp dimension of a 2-D mesh first (e.g. "
            f"amsp_ext.runtime.tensor_parallel.parallelize_llama)")
    if adaptive is not None:  # a re-plan would re-cut FSDP2's mesh from the (dp, tp) root: not built
        raise ValueError(f"amsp_ext.shard: config.tensor_parallel={T} does not support config.adaptive yet "
                         f"(allowed: tensor_parallel=1)")
    me = dist.get_rank()
    want = list(range(me - me % T, me - me % T + T))
    for n, p in dtensors:
        with compat.real_tensors():  # the mesh's rank table is host data, real even in a dry run
            ranks = sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist())
        if p.device_mesh.ndim != 1 or ranks != want:
            raise ValueError(
                f"amsp_ext.shard: parameter {n} is a DTensor on mesh ranks {ranks}; with "
                f"config.tensor_parallel={T} every TP parameter must be on the 1-D tp mesh of ranks {want} "
                f"(the inner dimension of a (dp, tp) mesh, consecutive ranks inside a node)")
        if not isinstance(p.placements[0], Shard):
            raise ValueError(
                f"amsp_ext.shard: parameter {n} is placed {p.placements[0]} on the tp mesh; the engine "
                f"supports Shard-placed TP parameters only (no sequence-parallel Replicate parameters)")


def check_tp_plan(plan: Plan, world: World) -> None:
    """What ``data_parallel_mesh`` cannot cut, refused before any collective."""
    if world.tensor_parallel > 1 and 1 < plan.sp < world.size and node_order(world) != list(range(world.num_nodes)):
        raise ValueError(f"plan {plan}: with tensor_parallel > 1, a parameter shard group smaller than the "
                         f"data-parallel world needs nodes in rank order (config.nodes_per_leaf=None); "
                         f"allowed there: sp = 1 or the whole data-parallel world")


def data_parallel_mesh(model: nn.Module, plan: Plan, world: World) -> DeviceMesh:
    """[Note: FSDP2's mesh under TP]
    FSDP2 (sp > 1) joins its mesh with the TP DTensors' mesh into one 2-D spec, which needs one
    root: its mesh must be cut from the model's own ``(dp, tp)`` mesh, not built from the plan's
    group. ZeRO-3's shard group is the whole ``dp`` dimension. A smaller one (``mics:K``,
    ``p=2x1`` ...) is ``dp`` unflattened into (other nodes, node_p, other local ranks, local_p),
    the order topology/groups.py lays data-parallel ranks out in, with its two ``_p`` dimensions
    flattened: one more group per dimension of size > 1, built only here. build_plan_mesh checks
    the result against the plan's param_shard group."""
    tp = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    root = compat.mesh_root(tp)
    names = root.mesh_dim_names or ()
    others = [d for d in names if d not in (tp.mesh_dim_names or ())]
    if root.ndim != 2 or len(others) != 1:
        raise ValueError(f"amsp_ext.shard: with tensor_parallel > 1 and sharded parameters (sp > 1) the TP "
                         f"mesh must be one dimension of a named 2-D (dp, tp) mesh, got {root}")
    if plan.sp == world.size:
        return root[others[0]]
    a = axis_sizes(plan, world)
    sizes = (a["node_outer"] * a["node_os"] * a["node_g"], a["node_p"],
             a["local_outer"] * a["local_os"] * a["local_g"], a["local_p"])
    tag = "x".join(map(str, sizes))
    flat = f"amsp_param_shard_{tag}"
    try:  # DeviceMesh refuses a second flatten of one name: a later shard() of this shape reuses it
        return root[flat]
    except KeyError:
        pass
    names = tuple(f"amsp_{d}_{tag}" for d in ("node_rest", "node_p", "local_rest", "local_p"))
    cut = compat.mesh_unflatten(root, others[0], sizes, names)
    return compat.mesh_flatten(cut[f"amsp_node_p_{tag}", f"amsp_local_p_{tag}"], flat)


def tensor_parallel_mesh(tensor_parallel: int, device_type: str) -> DeviceMesh:
    """torchtitan's 2-D mesh ``("dp", "tp")``: TP over consecutive ranks (inside a node)."""
    ws = dist.get_world_size()
    return init_device_mesh(device_type, (ws // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))


def check_llama_layout(model: nn.Module, tensor_parallel: int) -> list[nn.Module]:
    """The decoder layers of a model ``parallelize_llama`` can split T ways; ValueError otherwise."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if cfg is None or layers is None or not all(
            hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ValueError(f"tensor_parallel={tensor_parallel}: model {type(model).__name__} has no tensor-parallel "
                         f"layout (allowed: Llama-family models with model.layers[i].self_attn / .mlp)")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, field, None) or cfg.num_attention_heads
        if n % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide the model's {field} ({n}); "
                             f"allowed: the divisors of {n}")
    return list(layers)


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """The standard (Megatron) Llama layout on ``tp_mesh``: q/k/v and gate/up split by output
    features (colwise), o and down by input features (rowwise, one all-reduce each): two
    all-reduces per layer forward and two backward ([Note: one backward all-reduce per block]).
    Embedding, norms and lm_head stay whole ([Note: TP shards and replicated parameters]).
    Hugging Face's attention reshapes with ``view(*shape, -1, head_dim)``, so with local outputs
    each rank runs heads/T heads (and kv_heads/T key/value heads: the GQA ratio is unchanged)
    without touching the config.

    [Note: one backward all-reduce per block]
    Each column-parallel Linear makes its replicated input a DTensor of its own, so in backward
    each would all-reduce its own input gradient: 5 per layer (q, k, v, gate, up), 2.5 times the
    bytes Megatron's fused q/k/v and gate/up send (the dry run's TP log measured it:
    tools/dryrun.py TPLog). ``PrepareModuleInput`` on the attention and the MLP makes their input
    one Replicate DTensor that the Linears share, as torchtitan does: their Partial input
    gradients add up locally and one all-reduce per block turns the sum Replicate."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    shared = dict(desired_input_layouts=(Replicate(),), input_layouts=(Replicate(),), use_local_output=False)
    plan = {"self_attn": PrepareModuleInput(  # Hugging Face passes the attention's input by keyword
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp": PrepareModuleInput(**shared),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in check_llama_layout(model, tp_mesh.size()):
        parallelize_module(layer, tp_mesh, plan)
    return model
