"""Local assets for the TRL script tests (no Hub): one folder holding a tiny ``LlamaForCausalLM``
saved as sharded safetensors and a word-level tokenizer (built with ``tokenizers``, wrapped in
``PreTrainedTokenizerFast``), which tests/scripts/trl_train.py hands to TRL as ``model=<folder>``
so that TRL loads the model itself with ``from_pretrained``; and the ds_config that puts a TRL
trainer (an HF Trainer underneath) on AMSP.

The vocabulary is fixed: every word of the script's in-memory datasets is in it (no ``<unk>`` in
training), and the chat template is a plain one for conversational data (the script's datasets
are in TRL's standard format, which needs none).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = (
    "the a at cat dog bird fish sat ran flew swam on under over in mat rug tree lake big small red "
    "blue green happy sad fast slow and is was very good bad yes no what where who sees likes "
    "eats sleeps jumps runs walks sun moon sky day night home park user assistant system"
).split() + list(".,?!:")
VOCAB = 96  # the model's embedding rows: at least len(SPECIAL) + len(WORDS)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")


def tokenizer():
    """The word-level tokenizer: whitespace and punctuation split, the special tokens matched
    before the split (so ``"cat</s>"``, as TRL appends the EOS, is two tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    assert len(vocab) == len(SPECIAL) + len(WORDS) <= VOCAB, "duplicate word or vocabulary too big"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(root: Path) -> dict:
    """Write the model and its tokenizer into ``root / "model"`` (seed 0, fp32, untied
    embeddings, several safetensors shards) and return ``{"model": folder, "vocab": n}``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder = Path(root) / "model"
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id)
    model.save_pretrained(folder, max_shard_size="100KB")
    tok.save_pretrained(folder)
    return {"model": str(folder), "vocab": len(tok)}


def ds_config(plan: str, enabled: bool = True) -> dict:
    """The example configs/hf_trainer/ds_config.json (what HF Trainer users have: batch keys
    "auto", ZeRO stage 3) with ``amsp.plan`` fixed to ``plan`` for 2 ranks on one node, as
    test_integrations_frameworks._trainer builds it, less its optimizer and scheduler blocks: the
    Trainer then builds its own AdamW and schedule, as TRL users' configs usually leave it.
    ``enabled=False`` keeps the block but turns AMSP off (the ds_config is then DeepSpeed's)."""
    cfg = json.loads((REPO / "configs" / "hf_trainer" / "ds_config.json").read_text())
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    cfg["amsp"].update(enabled=enabled, plan=plan, gpus_per_node=2)
    return cfg
