"""The profile of the cluster a job runs on, found in the cache or measured by the job's ranks.

``shard(model, "auto")`` (and every route into it: ``amsp train`` when its launcher found no
cached profile, the ds_config block) with ``config.auto.profile == "cluster"`` calls
``cluster_profile`` on every rank before planning: the ranks' facts make the fingerprint
(topology/profile_cache.py [Note: the cluster fingerprint]), rank 0 looks it up in its cache and
broadcasts what it found, and when nothing usable is there every rank measures
(runtime/measure/profiler.py, the loop ``amsp profile`` runs) and rank 0 saves the result.

[Note: where the measurement runs]
In the job's ranks, with the job's own process group: only they see the links the job will use
(a launcher has no process group, and on the lab it is not even in the nodes' namespaces). A
launcher that can compute the same fingerprint (``amsp train`` starting its ranks on this host)
looks the cache up itself and plans before any rank starts; when the cache has nothing usable
it leaves plan "auto" to the ranks, which measure here. ``amsp profile --cache`` runs this same
function as a job of its own (what ``amsp compare`` runs before its rows when the cache has no
profile of the lab).

[Note: the cost of measuring]
Only the meshes the planner prices for a plan the pre-filter keeps (prefilter.priced_meshes),
one rank layout per shape with all its groups at once (runtime/measure/profile_cases.py [Note:
measuring the way training runs]), three sizes (1, 4, 16 MiB) with one warm-up and three timed
repetitions (ProfileConfig.quick). At 1,024 ranks (128 nodes x 8) that is 82 (op, mesh) cases:
82 x 3 sizes x 4 repetitions = 984 measured collectives, as many barriers and 246 MAX
all-reduces. Priced by the bundled paper-a800 table (the paper's 128 x 8 A800 cluster, alpha-beta
fit for the meshes it lacks) they take 0.77 s of link time (0.66 s the measured collectives,
0.09 s the barriers, 0.02 s the MAX all-reduces; tests/test_cluster_profile.py checks the sum
stays under 60 s). Not modelled: creating the process groups of the 39 rank layouts once each
(NCCL communicator set-up, not measured here) and Python's per-collective overhead.
The seconds a measurement took are in its start line and in the profile's source record
(``amsp compare`` keeps it as cluster-profile.json beside its results).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist

from amsp_ext.planner.profile import BandwidthProfile, load_profile
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.measure.profile_cases import ProfileConfig, profile_document
from amsp_ext.topology.groups import World
from amsp_ext.topology.profile_cache import (ClusterFingerprint, ProfileSource, host_facts, lookup, merge_facts,
                                             named_source, store)

__all__ = ["AUTO_PROFILE_CONFIG", "cluster_profile", "cluster_profile_named", "device_kind"]

AUTO_PROFILE_CONFIG = ProfileConfig.quick(priced_only=True)


def device_kind(backend: str) -> str:
    """The device part of the fingerprint: the GPU's name under NCCL, else "cpu"."""
    if backend == "nccl":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


def _fingerprint(comm: C.CollectiveContext, world: World, timeout: float) -> ClusterFingerprint:
    facts = C.all_gather_objects(comm, host_facts(), None, name="cluster_facts", timeout=timeout)
    backend = dist.get_backend()
    return merge_facts(facts, ranks_per_node=world.gpus_per_node, backend=backend, device=device_kind(backend))


def cluster_profile(comm: C.CollectiveContext, world: World, *, timeout: float,
                    log=print) -> tuple[BandwidthProfile, ProfileSource]:
    """Every rank: this cluster's profile and where it came from ([Note: where the measurement
    runs]). Rank 0 prints the one line saying so (and why a cached file was not used)."""
    rank = dist.get_rank()
    fingerprint = _fingerprint(comm, world, timeout)
    found = lookup(fingerprint) if rank == 0 else None
    verdict = (json.dumps({"doc": found.doc, "path": str(found.path), "age_s": found.age_s}).encode()
               if rank == 0 else None)
    got = json.loads(C.broadcast_bytes(comm, verdict, 0, name="cluster_profile", timeout=timeout))
    if got["doc"] is not None:
        source = ProfileSource(source="cache", path=got["path"], fingerprint=fingerprint, age_s=got["age_s"])
        doc = got["doc"]
    else:
        if found is not None and found.why:
            log(f"amsp: {found.why}; measuring this cluster again", file=sys.stderr)
        doc, seconds = _measure(comm, world, fingerprint, timeout)
        # rank 0's document (its clock's seconds, its date) on every rank: the ranks then plan
        # with one profile, and their configs' fingerprints agree (engine.check_same_everywhere)
        saved = (json.dumps({"doc": doc, "path": str(store(doc, fingerprint)), "seconds": seconds}).encode()
                 if rank == 0 else None)
        got = json.loads(C.broadcast_bytes(comm, saved, 0, name="cluster_profile", timeout=timeout))
        doc = got["doc"]
        source = ProfileSource(source="measured", path=got["path"], fingerprint=fingerprint,
                               seconds=got["seconds"])
    if rank == 0:
        log(source.line(), file=sys.stderr)
    return BandwidthProfile.from_dict(doc, source=source.path), source


def _measure(comm: C.CollectiveContext, world: World, fingerprint: ClusterFingerprint,
             timeout: float) -> tuple[dict, float]:
    from amsp_ext.runtime.measure.profiler import measure

    config = dataclasses.replace(AUTO_PROFILE_CONFIG, timeout_s=timeout)
    device = (torch.device("cuda", torch.cuda.current_device()) if fingerprint.backend == "nccl"
              else torch.device("cpu"))
    t0 = time.perf_counter()
    measurements = measure(config, world, device, comm=comm)
    seconds = time.perf_counter() - t0
    doc = profile_document(
        measurements, name=f"cluster-{fingerprint.key}", backend=fingerprint.backend,
        torch_version=torch.__version__.split("+")[0], world=world,
        link={"intra": "measured", "inter": fingerprint.lab or "measured"}, config=config,
        notes=f"measured by plan 'auto' in {seconds:.1f} s on the cluster {fingerprint.describe()}")
    return doc, seconds


def cluster_profile_named(name: str, log=print) -> ProfileSource:
    """Where a named profile (a bundled name or a file) comes from, said once by rank 0; a bad
    name is one line, here, before any collective."""
    source = named_source(name, load_profile(name).metadata)
    if dist.get_rank() == 0:
        log(source.line(), file=sys.stderr)
    return source
