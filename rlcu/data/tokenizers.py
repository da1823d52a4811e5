"""A synthetic word-level tokenizer over any vocabulary size: the speed workload's and the tests' (no
download)."""
from __future__ import annotations


def word_tokenizer(vocab_size: int):
    """Token i is the word `t{i}`; the last two ids are <pad> and <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab.update({"<pad>": vocab_size - 2, "<eos>": vocab_size - 1})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
