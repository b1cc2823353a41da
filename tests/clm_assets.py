"""Local assets for the third-party-style script tests (no Hub, no ``datasets``): text files cut
from the CPython reference manual (pydoc_data), a small byte-level BPE tokenizer trained on them
with ``tokenizers`` and wrapped in ``PreTrainedTokenizerFast``, a tiny Llama config, and the
reference evaluation used to check that a saved model reproduces the script's eval loss."""

from __future__ import annotations

from pathlib import Path

BLOCK = 32
VOCAB = 384


def _paragraphs() -> list[str]:
    import pydoc_data.topics as topics

    out = []
    for k in sorted(topics.topics):
        out.extend(p.strip().replace("\n", " ") for p in topics.topics[k].split("\n\n") if p.strip())
    return out


def _take(paras: list[str], chars: int) -> list[str]:
    out, n = [], 0
    for p in paras:
        if n >= chars:
            break
        out.append(p)
        n += len(p)
    return out


def build(root: Path) -> dict[str, str]:
    """Write ``train.txt``, ``valid.txt``, ``tokenizer/`` and ``config/`` under ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    paras = _paragraphs()
    train, valid = _take(paras[:200], 3400), _take(paras[400:], 1100)
    (root / "train.txt").write_text("\n".join(train) + "\n")
    (root / "valid.txt").write_text("\n".join(valid) + "\n")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(paras[:600], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(root / "tokenizer")
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    config.save_pretrained(root / "config")
    return {"train": str(root / "train.txt"), "valid": str(root / "valid.txt"),
            "tokenizer": str(root / "tokenizer"), "config": str(root / "config")}


def eval_blocks(valid_file: str, tokenizer_dir: str) -> list[list[int]]:
    """The validation blocks as both scripts cut them (tokenize each line, concatenate, cut)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids: list[int] = []
    for line in Path(valid_file).read_text().splitlines():
        if line.strip():
            ids.extend(tok(line)["input_ids"])
    n = len(ids) // BLOCK * BLOCK
    return [ids[i:i + BLOCK] for i in range(0, n, BLOCK)]


def reference_eval_loss(model_dir: str, valid_file: str, tokenizer_dir: str) -> float:
    """``from_pretrained`` the saved model in this process and average its loss over the
    validation blocks, one block per batch (what both scripts report with batch size 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    losses = []
    with torch.no_grad():
        for block in eval_blocks(valid_file, tokenizer_dir):
            ids = torch.tensor([block])
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    return sum(losses) / len(losses)
