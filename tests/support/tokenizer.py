"""A byte-level BPE tokenizer for the tiny model, trained locally (no download).

Its vocabulary fills the tiny model's 512 ids exactly (256 bytes, ``<s>`` / ``</s>``, merges), so
every id the model can produce decodes. Trained on seeded pseudo-words: the same tokenizer on every
run.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORDS = ("the a cat dog sat on mat river stone bird sings morning light falls over quiet hills and valleys "
         "where old trees grow tall under bright blue sky while children play near water clouds drift").split()


def sentence(rng: random.Random, n: int) -> str:
    """``n`` words of :data:`WORDS` drawn with ``rng``."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def train_tokenizer(path: str | Path, vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` (BOS ``<s>``, EOS ``</s>``, no special tokens added on
    encode) of ``vocab_size`` ids, saved in ``path`` (``save_pretrained``: ``AutoTokenizer`` loads it)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = list(WORDS) + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast
