"""A plain HF Trainer script (it never imports amsp_ext): tiny LlamaForCausalLM on real text with
``TrainingArguments(deepspeed=<ds_config.json>)``. With the ds_config's ``amsp.enabled`` (and
amsp_ext installed: its start-up hook), DeepSpeed is AMSP; with ``"enabled": false`` it is DeepSpeed.

    torchrun --nproc-per-node 2 tests/scripts/hf_trainer_train.py \\
        --deepspeed configs/hf_trainer/ds_config.json --output-dir /tmp/run [--resume-from DIR]
        [--from-pretrained MODEL_DIR]

Prints ``LOG {json}`` for each logged step (rank 0) and ``DATA {json}`` with the sample indices
each rank trained on.
"""

import argparse
import gc
import json
import os
import resource
import sys

import pydoc_data.topics as topics
import torch
from torch.utils.data import Dataset
from transformers import (AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback,
                          TrainingArguments)


class ByteText(Dataset):
    def __init__(self, num_samples: int, seq_len: int) -> None:
        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
        self.rows = [torch.tensor(list(text[i * seq_len:(i + 1) * seq_len])) for i in range(num_samples)]
        self.seen: list[int] = []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        self.seen.append(i)
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Print(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            emit("LOG " + json.dumps({"step": state.global_step, **logs}))


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", default=None, help="ds_config.json (none: the Trainer's DDP)")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=2, help="0: do not save")
    ap.add_argument("--resume-from", default=None, metavar="CHECKPOINT_DIR")
    ap.add_argument("--from-pretrained", default=None, metavar="DIR",
                    help="load the model with from_pretrained (else from_config, seed 0)")
    ap.add_argument("--eval", choices=["only", "after"], default=None,
                    help="only: trainer.evaluate() and no training (the model is prepared for "
                         "inference alone); after: evaluate after train(); print EVAL {json}")
    ap.add_argument("--optim", default=None, help="TrainingArguments.optim (e.g. adafactor)")
    ap.add_argument("--samples", type=int, default=64, help="training samples (the data set)")
    ap.add_argument("--epochs", type=float, default=None,
                    help="num_train_epochs instead of --steps (an epoch's last accumulation "
                         "window is short when the batches per rank are not a multiple of 2)")
    args = ap.parse_args()

    targs = TrainingArguments(**({"optim": args.optim} if args.optim else {}),
        output_dir=args.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=-1 if args.epochs else args.steps, num_train_epochs=args.epochs or 3.0, learning_rate=1e-3, warmup_steps=1, weight_decay=0.1,
        logging_steps=1, save_steps=args.save_steps or None,
        save_strategy="steps" if args.save_steps else "no", report_to=[],
        deepspeed=args.deepspeed, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_only_model=False)
    # the model after TrainingArguments, as the HF docs ask for ZeRO-3 (from_config would then
    # build it inside deepspeed.zero.Init if ZeRO-3 were on)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    load = {}
    if args.from_pretrained:
        rss0, peak0 = _rss(), _peak_rss()
        model = AutoModelForCausalLM.from_pretrained(args.from_pretrained, attn_implementation="eager")
        load = {"load_rss_growth": _rss() - rss0, "load_peak_growth": max(0, _peak_rss() - rss0),
                "peak_before_load_above_rss": peak0 - rss0,
                "loaded_on_meta": all(p.is_meta for p in model.parameters()),
                "loaded_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                          if not p.is_meta)}
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    from transformers.integrations import is_deepspeed_zero3_enabled

    zero3 = {"zero3_enabled": is_deepspeed_zero3_enabled(),
             "ds_partitioned": any(hasattr(p, "ds_id") for p in model.parameters())}
    data = ByteText(args.samples, 32)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Print()],
                      eval_dataset=ByteText(72, 32) if args.eval else None)
    emit("SETUP " + json.dumps({"rank": targs.process_index, "world_size": targs.world_size, **zero3,
                                 **load}))
    if args.eval == "only":  # no training: the Trainer prepares the model for inference alone
        emit("EVAL " + json.dumps({"when": "only", **trainer.evaluate()}))
    else:
        trainer.train(resume_from_checkpoint=args.resume_from)
    if args.eval == "after":
        emit("EVAL " + json.dumps({"when": "after", **trainer.evaluate()}))
    emit("DATA " + json.dumps({"rank": targs.process_index, "engine": type(trainer.model_wrapped).__name__,
                                "samples": data.seen}))
    # tear the process group down in step: a live gloo group (with DDP's reducer) can abort at
    # interpreter exit ("terminate called without an active exception", ~1 in 3 DDP runs here)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        del trainer, model
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
