"""A word-level tokenizer ("w3", "w4", ... one id each) saved beside a random GPU test model:
the GPU machine has no packaged tokenizer, and these tests pass token ids."""
from __future__ import annotations

from typing import Any

# Roles and tokens of a decoder's specials (ids 0, 1, 2 in this order).
DECODER_SPECIALS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


def save_word_tokenizer(path: str, vocab_size: int,
                        specials: dict[str, str] = DECODER_SPECIALS, **kwargs: Any) -> None:
    """The specials take the first ids, then "w{i}" for every id up to `vocab_size`; `kwargs`
    go to PreTrainedTokenizerFast (model_max_length...). `specials` must hold an unk_token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {token: i for i, token in enumerate(specials.values())}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials, **kwargs).save_pretrained(path)
