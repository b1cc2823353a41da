"""A plain DeepSpeed training script in the style of DeepSpeedExamples (written for these tests;
it never imports amsp_ext): ``deepspeed.add_config_arguments``, ``deepspeed.initialize(args=...,
training_data=...)``, epochs over the loader DeepSpeed builds, ``engine.backward`` /
``engine.step``, ``save_checkpoint`` with a client state, ``load_checkpoint`` to resume, and
``save_16bit_model`` at the end.

    torchrun --nproc-per-node 2 ds_train.py --deepspeed --deepspeed_config ds_config.json \\
        --config_name cfg/ --train_file train.txt --tokenizer_name tok/ --save_dir ckpt/ \\
        --save_at 3 [--load_dir ckpt/] --output_dir out/

Prints ``STEP {json}`` per optimizer step (rank 0: step, epoch, loss averaged over ranks, the
sample indices each rank read) and ``ENGINE {json}`` (the engine's class and module class).
"""

import argparse
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


class Blocks(torch.utils.data.Dataset):
    def __init__(self, path, tokenizer, block_size):
        ids = []
        with open(path) as f:
            for line in f.read().splitlines():
                if line.strip():
                    ids.extend(tokenizer(line)["input_ids"])
        n = len(ids) // block_size * block_size
        self.rows = [torch.tensor(ids[i:i + block_size]) for i in range(0, n, block_size)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "index": i}


def emit(tag, obj):
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--config_name", required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max_samples", type=int, default=16)
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--save_at", type=int, default=0, help="save a checkpoint after this step")
    parser.add_argument("--load_dir", default=None)
    parser.add_argument("--output_dir", default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.config_name)
    model = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    data = Blocks(args.train_file, tokenizer, args.block_size)
    data.rows = data.rows[:args.max_samples]
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model,
                                                model_parameters=model.parameters(),
                                                training_data=data)
    emit("ENGINE", {"rank": dist.get_rank(), "engine": type(engine).__name__,
                    "module": type(engine.module).__name__})
    start_epoch, step = 0, 0
    if args.load_dir:
        _, client = engine.load_checkpoint(args.load_dir)
        start_epoch, step = client["epoch"], client["step"]
    gas = engine.gradient_accumulation_steps()
    for epoch in range(start_epoch, args.epochs):
        losses, seen = [], []
        for micro, batch in enumerate(loader):
            ids = batch["input_ids"].to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            seen.extend(batch["index"].tolist())
            if len(losses) == gas:  # engine.step() just stepped the optimizer
                step += 1
                mean = torch.tensor([sum(losses) / len(losses)])
                dist.all_reduce(mean)
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, seen)
                if dist.get_rank() == 0:
                    emit("STEP", {"step": step, "epoch": epoch, "loss": mean.item() / dist.get_world_size(),
                                  "samples": everyone})
                losses, seen = [], []
                if args.save_dir and step == args.save_at:
                    engine.save_checkpoint(args.save_dir, client_state={"epoch": epoch, "step": step})
    if args.output_dir:
        engine.save_16bit_model(args.output_dir)
        if dist.get_rank() == 0:
            config.save_pretrained(args.output_dir)
    dist.barrier()


if __name__ == "__main__":
    main()
