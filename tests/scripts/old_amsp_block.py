"""An old-shape ``"amsp"`` block (the one ``amsp migrate`` wrote before the engine had one config)
loaded by a plain script under plain ``python``, one process: through ``deepspeed.initialize``
(``--route deepspeed``) or the HF Trainer (``--route trainer``). It never imports amsp_ext (the
start-up hook routes DeepSpeed to AMSP); what it prints on stderr is the test's.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python old_amsp_block.py CONFIG --route R
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--route", choices=["deepspeed", "trainer"], required=True)
    args = ap.parse_args()
    if args.route == "deepspeed":
        import deepspeed

        m = model()
        deepspeed.initialize(model=m, model_parameters=m.parameters(), config=args.config)
        return
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(2)]
    targs = TrainingArguments(output_dir="out", deepspeed=args.config, use_cpu=True, max_steps=1,
                              per_device_train_batch_size=1, report_to=[], save_strategy="no",
                              disable_tqdm=True)
    Trainer(model=model(), args=targs, train_dataset=rows).train()


if __name__ == "__main__":
    main()
