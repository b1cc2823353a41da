"""A plain TRL script (it never imports amsp_ext): ``SFTTrainer``, ``DPOTrainer`` or
``GRPOTrainer`` on CPU, fp32, with ``model=<local folder>`` (TRL loads it with from_pretrained),
that folder's tokenizer and a tiny in-memory ``datasets.Dataset`` in TRL's standard format. With
``--deepspeed`` the config's ``deepspeed=`` is that ds_config (its ``amsp.enabled`` and amsp_ext's
start-up hook make DeepSpeed AMSP); without it the Trainer runs DDP (launch with
ACCELERATE_USE_CPU=true on CPU). The model folder comes from tests/trl_assets.build.

    torchrun --nproc-per-node 2 tests/scripts/trl_train.py --trainer {sft,dpo,grpo} \\
        --model MODEL_DIR --output-dir /tmp/run [--deepspeed ds_config.json] [--max-steps 3]
        [--peft] [--gradient-checkpointing]

Rank 0 prints ``LOG {json}`` for each logged step (the Trainer's logs: step, loss, grad_norm,
learning_rate, and each trainer's own metrics, e.g. DPO's rewards/chosen, GRPO's reward and kl)
and ``DONE {json}`` with train()'s metrics and the engine that wrapped the model.
"""

import argparse
import gc
import json
import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

# training samples: every word is in tests/trl_assets.WORDS
SENTENCES = [
    "the cat sat on the mat.", "a dog ran in the park.", "the bird flew over the tree.",
    "a fish swam in the lake.", "the big dog sleeps at home.", "a small cat jumps on the rug.",
    "the red bird sees the sun.", "a blue fish likes the lake.", "the happy dog runs and walks.",
    "the sad cat eats at night.", "a green tree is very big.", "the sky was blue and the sun was big.",
    "the moon is in the sky at night.", "a slow fish swam under the tree.",
    "the fast dog ran over the rug.", "a good cat sat on a mat.",
]
PROMPTS = ["the cat", "a dog", "the bird", "a fish", "the sun", "the moon", "a big tree", "the park"]
DPO = [  # (prompt, chosen, rejected): chosen and rejected start with a space (prompt + chosen is one text)
    ("the cat", " sat on the mat.", " flew over the lake."),
    ("a dog", " ran in the park.", " swam under the moon."),
    ("the bird", " flew over the tree.", " eats the sun."),
    ("a fish", " swam in the lake.", " walks home at night."),
    ("the sun", " is in the sky.", " sleeps on the rug."),
    ("the moon", " is big at night.", " runs in the park."),
    ("who sees the cat ?", " the dog sees the cat.", " no."),
    ("where is the fish ?", " in the lake.", " the sky was red."),
]


def reward_len(completions, **kwargs):
    """GRPO reward: the completion's length in characters, over 10 (varies with the words drawn
    and with an early EOS)."""
    return [len(c) / 10.0 for c in completions]


class Print(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            emit("LOG " + json.dumps({"step": state.global_step, **logs}))


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: ranks share the launcher's stdout
    sys.stdout.flush()


def common(args) -> dict:
    """The TrainingArguments every trainer gets: CPU, fp32, 2 samples a rank a step, seeded,
    samples in dataset order (the same ones under DDP and AMSP), no saving, no reporting."""
    return dict(
        output_dir=args.output_dir, use_cpu=True, bf16=False, fp16=False, report_to=[],
        logging_steps=1, max_steps=args.max_steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, learning_rate=1e-3, warmup_steps=0, seed=0, data_seed=0,
        dataloader_drop_last=True, dataloader_num_workers=0, save_strategy="no",
        gradient_checkpointing=args.gradient_checkpointing, deepspeed=args.deepspeed,
        disable_tqdm=True)


def build_trainer(args, tok, peft_config):
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common(args), train_sampling_strategy="sequential", max_length=32)
        return SFTTrainer(model=args.model, args=config, processing_class=tok,
                          train_dataset=Dataset.from_dict({"text": SENTENCES}),
                          peft_config=peft_config, callbacks=[Print()])
    if args.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        # --sync-ref: TRL's sync_ref_model writes the policy into the reference after every step
        sync = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5) if args.sync_ref else {}
        config = DPOConfig(**common(args), train_sampling_strategy="sequential", beta=0.1, max_length=32, **sync)
        data = Dataset.from_dict({"prompt": [p for p, _, _ in DPO], "chosen": [c for _, c, _ in DPO],
                                  "rejected": [r for _, _, r in DPO]})
        return DPOTrainer(model=args.model, args=config, processing_class=tok, train_dataset=data,
                          peft_config=peft_config, callbacks=[Print()])
    from trl import GRPOConfig, GRPOTrainer

    # 2 ranks x 2 completions a rank a step = 4 = 2 prompts x num_generations 2, one generation a step
    config = GRPOConfig(**common(args), beta=0.04, num_generations=2, max_completion_length=4,
                        generation_batch_size=4, shuffle_dataset=False)
    return GRPOTrainer(model=args.model, reward_funcs=reward_len, args=config, processing_class=tok,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=peft_config,
                       callbacks=[Print()])


def count_gathers_in_generate(model) -> None:
    """Print ``GEN {"all_gathers": n}`` (rank 0) for every ``generate`` call: the all-gathers
    dispatched inside it (ZeRO-3 and AMSP's sharded plans gather the weights once around the
    generation, not once per token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allgather" in func.__name__ or "all_gather" in func.__name__:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    original = model.generate

    def generate(*args, **kwargs):
        Count.n = 0
        with Count():
            out = original(*args, **kwargs)
        if torch.distributed.get_rank() == 0:
            emit("GEN " + json.dumps({"all_gathers": Count.n}))
        return out

    model.generate = generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainer", choices=["sft", "dpo", "grpo"], required=True)
    ap.add_argument("--model", required=True, help="local model folder (with its tokenizer)")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--deepspeed", default=None, help="ds_config.json (none: the Trainer's DDP)")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--peft", action="store_true", help="train a LoRA adapter (r=4 on q_proj, v_proj)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--sync-ref", action="store_true", help="DPO: sync_ref_model every step (alpha 0.5)")
    args = ap.parse_args()

    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM")
    tok = AutoTokenizer.from_pretrained(args.model)
    trainer = build_trainer(args, tok, peft_config)
    if args.trainer == "grpo":
        count_gathers_in_generate(trainer.model)
    out = trainer.train()
    if trainer.args.process_index == 0:
        emit("DONE " + json.dumps({**out.metrics, "global_step": out.global_step,
                                   "engine": type(trainer.model_wrapped).__name__,
                                   "world_size": trainer.args.world_size}))
    # tear the process group down in step: a live gloo group (with DDP's reducer) can abort at
    # interpreter exit (as tests/scripts/hf_trainer_train.py does)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        del trainer
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
