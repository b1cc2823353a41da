"""DeepSpeed's checkpoint layout on top of AMSP's sharded checkpoints.

    save_dir/
      latest            <- the tag of the newest checkpoint (text), as DeepSpeed writes it
      global_step42/    <- one AMSP checkpoint (amsp_ext.save_checkpoint: DCP shards + amsp.json),
                           written next to itself and published by one rename once every rank
                           finished; ``latest`` is replaced after that, so it never names a
                           partial checkpoint. Loading verifies every file's checksum.

The HF Trainer resumes from a ``checkpoint-N`` directory when it finds ``global_step*`` in it
and then calls ``engine.load_checkpoint(dir)``, which reads ``latest``; Accelerate's
``save_state``/``load_state`` call ``save_checkpoint(dir, "pytorch_model")`` and
``load_checkpoint(dir, "pytorch_model")``. The engine's counters (global steps and samples,
skipped steps, micro steps), ``client_state`` and the position of the ``training_data`` loader
travel in the checkpoint's ``extra``; the LR scheduler's state in its own slot. Loading works under another plan or world size (AMSP
reshards on load); the counters are restored as saved. ``load_optimizer_states=False`` restores
the weights and counters only, ``load_module_only=True`` the weights only (as DeepSpeed).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

from amsp_ext.integrations.settings import ConfigError
from amsp_ext.runtime.state import checkpoint as ckpt

# ``engine`` below is the AMSPDeepSpeedEngine (integrations/engine.py) that calls these functions;
# it is not imported here, so the dependency stays one-way (engine -> checkpoint).

__all__ = ["load_ds_checkpoint", "save_ds_checkpoint"]

FORMAT = "amsp-deepspeed/1"
LATEST = "latest"


def _check_same_tag(comm, tag: str, timeout: float) -> None:
    """DeepSpeed's tag validation: every rank must save under the same tag."""
    from amsp_ext.runtime import collectives as C

    digest = hashlib.sha1(tag.encode()).digest()[:16]
    got = C.all_gather_bytes(comm, digest, None, name="world", timeout=timeout)
    if any(g != digest for g in got):
        bad = next(r for r, g in enumerate(got) if g != digest)
        raise ConfigError(f"checkpoint tag {tag!r} differs between ranks (rank {bad} has another); "
                          f"the tag must be the same on every rank")


def _own_loader(engine):
    """The loader ``initialize`` built from ``training_data`` (None for the script's own)."""
    from amsp_ext.integrations.dataloader import AMSPDataLoader

    loader = engine.training_dataloader
    return loader if isinstance(loader, AMSPDataLoader) else None


def save_ds_checkpoint(engine, save_dir, tag=None, client_state=None,
                       save_latest: bool = True) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    _check_same_tag(engine.module.amsp.comm, tag, engine.amsp_settings.engine.timeout)
    save_dir = Path(save_dir)
    path = save_dir / tag  # staged next to itself and published whole (amsp_ext save_checkpoint)
    extra = {"format": FORMAT, "client_state": dict(client_state or {}),
             "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps}}
    loader = _own_loader(engine)
    if loader is not None:  # the training_data loader's epoch and position (integrations/dataloader.py)
        extra["dataloader"] = loader.state_dict()
    ckpt.save_checkpoint(engine.module, engine.optimizer, path, lr_scheduler=engine.lr_scheduler,
                         extra=extra)
    if save_latest and engine.global_rank == 0:
        tmp = save_dir / f".{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, save_dir / LATEST)
    from amsp_ext.runtime import collectives as C

    C.barrier(engine.module.amsp.comm, None, name="world")  # every rank sees ``latest`` on return
    return str(path)


def load_ds_checkpoint(engine, load_dir, tag=None, *,
                       load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                       load_module_only: bool = False) -> tuple[str | None, dict | None]:
    load_dir = Path(load_dir)
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            warnings.warn(f"amsp: no {LATEST!r} file in {load_dir}; pass a tag to load a checkpoint",
                          stacklevel=3)
            return None, None
        tag = latest.read_text().strip()
    path = load_dir / str(tag)
    with_states = load_optimizer_states and not load_module_only
    sched = engine.lr_scheduler if (load_lr_scheduler_states and not load_module_only) else None
    extra = ckpt.load_checkpoint(engine.module, engine.optimizer, path, lr_scheduler=sched,
                                 optimizer_states=with_states)
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise ConfigError(f"{path} is an AMSP checkpoint but not one written by engine.save_checkpoint")
    if not load_module_only:  # as DeepSpeed: the counters come back unless only the module does
        for k, v in extra["engine"].items():
            setattr(engine, k, v)
        loader = _own_loader(engine)
        if loader is not None and extra.get("dataloader") is not None:
            loader.load_state_dict(extra["dataloader"])
    engine.optimizer.overflow = False
    return str(path), extra["client_state"]
