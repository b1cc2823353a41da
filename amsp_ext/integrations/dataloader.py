"""The loader ``amsp_ext.initialize`` builds from ``training_data=`` (DeepSpeed's ``deepspeed_io``).

    engine, _, loader, _ = deepspeed.initialize(..., training_data=dataset)
    for epoch in range(epochs):
        for batch in loader: ...

[Note: epochs]
Each ``iter(loader)`` is one epoch. Like DeepSpeed's loader it reads this rank's share of the
data through a ``DistributedSampler`` (shuffled, seed 0) in micro-batches of
``train_micro_batch_size_per_gpu``; unlike DeepSpeed 0.18.9's, it calls ``set_epoch`` before
every epoch, so each epoch is shuffled differently and identically on every rank (DeepSpeed's
loader never calls it: every epoch repeats the first one's order).

[Note: position in checkpoints]
``state_dict()`` is ``{"epoch", "batches", "batch_size", "world_size"}``: the epoch being read and
how many micro-batches of it this loader has handed out. ``engine.save_checkpoint`` stores it,
``engine.load_checkpoint`` restores it: the next ``iter(loader)`` continues that epoch right
after the last batch handed out (skipping by sample index, without loading the skipped
samples), then epochs go on from there. Under another world size or micro-batch size the
position is carried over as the number of samples consumed from the epoch's global order
(rank r reads positions r, r + W, ...: after k batches of b on W ranks, exactly the first
k*b*W); if that count is not a whole number of new batches, the loader resumes at the batch
that contains it and warns.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["AMSPDataLoader"]


class AMSPDataLoader:
    """``training_data`` as this rank's micro-batches, with epochs and a resumable position."""

    def __init__(self, dataset, *, batch_size: int, rank: int, world_size: int, collate_fn=None,
                 drop_last: bool = False, seed: int = 0) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.data_sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                               shuffle=True, seed=seed)
        self.sampler = self.data_sampler
        self.epoch = 0
        self.batches = 0  # handed out in ``epoch``
        self._started = False
        self._resume: tuple[int, int] | None = None  # (epoch, batches) from load_state_dict

    def __len__(self) -> int:
        n = len(self.data_sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        if self._resume is not None:
            epoch, skip = self._resume
            self._resume = None
        else:
            epoch, skip = (self.epoch + 1 if self._started else 0), 0
        if skip >= len(self):  # saved at the end of an epoch: the next one starts
            epoch, skip = epoch + 1, 0
        self.epoch, self.batches, self._started = epoch, skip, True
        self.data_sampler.set_epoch(epoch)
        indices = list(self.data_sampler)[skip * self.batch_size:]
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices,
                            collate_fn=self.collate_fn, drop_last=self.drop_last)
        for batch in loader:
            self.batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self.batches, "batch_size": self.batch_size,
                "world_size": self.world_size, "started": self._started}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state.get("started", True):
            self._resume, self._started = None, False
            return
        epoch, batches = int(state["epoch"]), int(state["batches"])
        old = int(state["batch_size"]) * int(state["world_size"])
        new = self.batch_size * self.world_size
        if old != new:
            consumed = batches * old
            batches = consumed // new
            if consumed % new:
                warnings.warn(f"amsp: the data loader was saved after {consumed} samples of epoch "
                              f"{epoch} ({state['batch_size']} x {state['world_size']} ranks per "
                              f"batch); with {self.batch_size} x {self.world_size} it resumes at "
                              f"sample {batches * new}", stacklevel=2)
        self._resume = (epoch, batches)
        self.epoch, self.batches, self._started = epoch, batches, True
