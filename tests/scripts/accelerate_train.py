"""A plain Accelerate training script (it never imports amsp_ext, except with --explicit-amsp): tiny Llama, real text, AdamW,
gradient accumulation with ``accelerator.accumulate``, clipping, and a save_state/load_state
round trip. Prints one ``RECORD {json}`` line per optimizer step and rank.

    accelerate launch --config_file configs/accelerate/amsp.yaml tests/scripts/accelerate_train.py
"""

import argparse
import json
import sys

import pydoc_data.topics as topics
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM


DS_KEYS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "zero_optimization": {"stage": 0}}


class ByteText(Dataset):
    """Fixed windows of the CPython reference manual as byte tokens (sample i is row i)."""

    def __init__(self, num_samples: int, seq_len: int) -> None:
        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
        self.rows = [torch.tensor(list(text[i * (seq_len + 1):(i + 1) * (seq_len + 1)]))
                     for i in range(num_samples)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "index": i}


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()


def check_saves(accelerator, model, root: str) -> None:
    """Every way an Accelerate script saves the model, against amsp_ext's consolidated weights
    (the only place this script imports amsp_ext besides --explicit-amsp)."""
    import os

    from safetensors.torch import load_file

    import amsp_ext

    unwrapped = accelerator.unwrap_model(model)
    ref = amsp_ext.consolidated_state_dict(unwrapped, rank0_only=False)  # fp32, collective
    got = {
        "get_state_dict": accelerator.get_state_dict(model),
        "unwrap_model.state_dict": unwrapped.state_dict(),
    }
    for name, kwargs in (("save_pretrained", {}),
                         ("save_pretrained+state_dict", {"state_dict": accelerator.get_state_dict(model)})):
        out = os.path.join(root, name)
        unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process,
                                  save_function=accelerator.save, **kwargs)
        accelerator.wait_for_everyone()
        got[name] = load_file(os.path.join(out, "model.safetensors"))
    diffs = {}
    for name, sd in got.items():
        same_keys = sorted(sd) == sorted(ref)
        diffs[name] = (max(float((sd[k].float().cpu() - ref[k]).abs().max()) for k in ref)
                       if same_keys else f"keys differ: {sorted(set(sd) ^ set(ref))[:3]}")
    if accelerator.is_main_process:
        emit("SAVES " + json.dumps({"unwrapped_class": type(unwrapped).__name__,
                                    "is_engine": type(unwrapped).__name__ == "AMSPDeepSpeedEngine",
                                    "num_keys": len(ref), "max_abs_diff": diffs}))


def reload_eval(accelerator, model, out: str, seq_len: int) -> None:
    """transformers' run_clm_no_trainer pattern: save the trained model, reload it on rank 0 with
    from_pretrained, evaluate; the trained model's eval loss on the same batch beside it."""
    ids = ByteText(4, seq_len).rows[-1][None]
    model.eval()
    with torch.no_grad():  # every rank: the forward of a sharded model is collective
        trained = float(model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        reloaded = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager")
        reloaded.eval()
        with torch.no_grad():
            loss = float(reloaded(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)
        emit("RELOAD " + json.dumps({"trained": trained, "reloaded": loss,
                                     "on_meta": any(p.is_meta for p in reloaded.parameters())}))
    accelerator.wait_for_everyone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--save-dir", default=None,
                    help="save_state after --save-at steps, spoil the weights, load_state")
    ap.add_argument("--save-at", type=int, default=2)
    ap.add_argument("--explicit-amsp", metavar="JSON", default=None,
                    help="the explicit route instead: amsp_ext.accelerate.Accelerator(amsp=JSON)")
    ap.add_argument("--check-saves", metavar="DIR", default=None,
                    help="(with --explicit-amsp) save every way Accelerate users do, compare with "
                         "amsp_ext.consolidated_state_dict, print SAVES {json}")
    ap.add_argument("--from-pretrained", metavar="FOLDER", default=None,
                    help="start from a saved model (from_pretrained) instead of the seeded config")
    ap.add_argument("--reload-eval", metavar="DIR", default=None,
                    help="after training: save_pretrained to DIR, rank 0 reloads it with "
                         "from_pretrained and evaluates; print RELOAD {json}")
    args = ap.parse_args()

    if args.explicit_amsp:  # the only place this script may import amsp_ext
        from amsp_ext.accelerate import Accelerator as AMSPAccelerator

        accelerator = AMSPAccelerator(amsp=json.loads(args.explicit_amsp), gradient_accumulation_steps=args.gas,
                                      deepspeed_config={**DS_KEYS, "gradient_clipping": 1.0})
    else:
        accelerator = Accelerator(gradient_accumulation_steps=args.gas)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"
    if args.from_pretrained:
        model = LlamaForCausalLM.from_pretrained(args.from_pretrained, attn_implementation="eager")
    else:
        model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    n = args.steps * args.gas * accelerator.num_processes
    loader = DataLoader(ByteText(n, args.seq_len), batch_size=1, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.is_main_process:
        emit("SETUP " + json.dumps({"distributed_type": str(accelerator.distributed_type),
                                     "num_processes": accelerator.num_processes,
                                     "model_class": type(model).__name__}))
    model.train()
    # an EMA of the weights, fed right after each optimizer step from parameter references taken
    # before training (as EMA helpers keep them); its checksum goes into each RECORD
    params = list(accelerator.unwrap_model(model).parameters())
    with torch.no_grad():
        ema = [p.detach().clone() for p in params]
    step, losses, seen = 0, [], []
    for batch in loader:
        with accelerator.accumulate(model):
            ids = batch["input_ids"]
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        seen.extend(batch["index"].tolist())
        if accelerator.sync_gradients:
            with torch.no_grad():
                for e, p in zip(ema, params):
                    e.mul_(0.5).add_(p.detach(), alpha=0.5)
                # a DTensor (sharded parameters) is summed whole: collective, every rank calls it
                checksum = sum(float((e.full_tensor() if hasattr(e, "full_tensor") else e).double().sum())
                               for e in ema)
            emit("RECORD " + json.dumps({"rank": accelerator.process_index, "step": step,
                                          "losses": losses, "samples": seen, "ema": checksum}))
            step, losses, seen = step + 1, [], []
            if args.save_dir and step == args.save_at:
                accelerator.save_state(args.save_dir)
                accelerator.wait_for_everyone()  # DDP: rank 0 writes, every rank reads
                with torch.no_grad():  # spoil the weights: only load_state can bring them back
                    for p in model.parameters():
                        p.add_(1.0)
                accelerator.load_state(args.save_dir)
                accelerator.wait_for_everyone()
    if args.check_saves:
        check_saves(accelerator, model, args.check_saves)
    if args.reload_eval:
        reload_eval(accelerator, model, args.reload_eval, args.seq_len)
    # tear the process group down in step: exiting with a live gloo group can abort at interpreter
    # exit ("terminate called without an active exception", ~1 in 4 DDP runs on this machine)
    accelerator.wait_for_everyone()
    del model, optimizer, loader
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
