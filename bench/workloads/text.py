"""Seeded filler text of a chosen length in tokens.

Prompts are random sequences of common words, so two pieces of text share a prefix only when
a workload reuses them on purpose. Lengths are set in tokens of the fleet's tokenizer: the
words-per-token ratio is measured once on a sample, and every piece is cut to its word count.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["WORDS", "TextSource"]

_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can out some time only new about two may first then do any like my now "
    "over such our man me even most made after also did many before must through years where "
    "much your way well down should because each just those people how too little state good "
    "very make world still own see men work long here get both between life being under "
    "never day same another know while last might us great old year off come since against "
    "go came right used take three cache router replica prefix token block model request "
    "latency memory tier storage engine schedule batch queue index event stream policy "
    "session document question answer agent tool result search read write file code function "
    "value system user assistant data table record report market price order customer "
    "product service network server client error retry history summary detail section "
    "chapter figure example number level point group field "
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class TextSource:
    """Random word text; ``count_tokens`` calibrates words per token (None: 0.5 per word)."""

    def __init__(self, seed: int, count_tokens: Callable[[str], int] | None = None) -> None:
        self.rng = random.Random(seed)
        self.tokens_per_word = 2.0
        if count_tokens is not None:
            sample = " ".join(random.Random(0).choice(WORDS) for _ in range(4000))
            self.tokens_per_word = count_tokens(sample) / 4000

    def text(self, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of fresh text."""
        n_words = max(1, round(n_tokens / self.tokens_per_word))
        choice = self.rng.choice
        return " ".join(choice(WORDS) for _ in range(n_words))
