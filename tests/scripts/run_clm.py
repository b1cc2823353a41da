"""Causal language modelling with the HF Trainer, in the style of transformers'
``examples/pytorch/language-modeling/run_clm.py`` (written for these tests; it never imports
amsp_ext). Local files only: ``--config_name`` / ``--tokenizer_name`` are directories,
``--train_file`` / ``--validation_file`` plain text; no Hub, no ``datasets``, no ``evaluate``.

    torchrun --nproc-per-node 2 run_clm.py --config_name cfg/ --tokenizer_name tok/ \\
        --train_file train.txt --validation_file valid.txt --do_train --do_eval \\
        --output_dir out/ --deepspeed ds_config.json [--resume_from_checkpoint out/checkpoint-3]

Everything it reports is what run_clm reports: ``trainer.save_model()``, ``train_results.json``,
``eval_results.json`` (eval_loss, perplexity) and ``trainer_state.json`` (the log history).
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser,
                          Trainer, TrainingArguments, default_data_collator, set_seed)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    config_name: str = field(metadata={"help": "config directory (the model is trained from scratch)"})
    tokenizer_name: str = field(metadata={"help": "tokenizer directory"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "training text file"})
    validation_file: str = field(metadata={"help": "evaluation text file"})
    block_size: int = field(default=32)
    max_train_samples: int | None = field(default=None)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def load_blocks(path, tokenizer, block_size):
    """Tokenize every line, concatenate, cut into ``block_size`` blocks (run_clm's group_texts)."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    ids = []
    for line in lines:
        ids.extend(tokenizer(line)["input_ids"])
    total = (len(ids) // block_size) * block_size
    return Blocks([{"input_ids": ids[i:i + block_size], "labels": ids[i:i + block_size],
                    "attention_mask": [1] * block_size} for i in range(0, total, block_size)])


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(f"Process rank: {training_args.local_process_index}, device: {training_args.device}, "
                   f"n_gpu: {training_args.n_gpu}, distributed training: "
                   f"{training_args.parallel_mode.value == 'distributed'}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)

    config = AutoConfig.from_pretrained(model_args.config_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    logger.info(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    train_dataset = load_blocks(data_args.train_file, tokenizer, data_args.block_size)
    eval_dataset = load_blocks(data_args.validation_file, tokenizer, data_args.block_size)
    if data_args.max_train_samples is not None:
        train_dataset = Blocks(train_dataset.rows[:data_args.max_train_samples])

    trainer = Trainer(model=model, args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=eval_dataset if training_args.do_eval else None,
                      processing_class=tokenizer, data_collator=default_data_collator)

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            perplexity = math.exp(metrics["eval_loss"])
        except OverflowError:
            perplexity = float("inf")
        metrics["perplexity"] = perplexity
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
