"""open_clip's CLIP tokenizer, faster per caption and with the same ids (docs/data-path.md,
"Tokenizer"). ``fast_tokenizer(tokenize)`` wraps an open_clip ``SimpleTokenizer`` with its default
cleaning ('lower', no reduction); anything else is returned as is.

Same ids because a caption of printable ASCII, tabs and newlines without '&' is what ftfy and
html.unescape leave unchanged (ftfy's fixes touch only non-ASCII text, control characters, line
breaks other than '\\n' and HTML entities): only the whitespace cleaning and lower-casing run on
it; any other caption takes open_clip's own cleaning (tests/data/test_tokens.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import numpy as np
import torch

_PLAIN = re.compile(r"[\x20-\x25\x27-\x7e\t\n]*")  # printable ASCII but '&', tab, newline


class FastClipTokenizer:
    """Same ids as the wrapped open_clip SimpleTokenizer (clean='lower', no reduction)."""

    MAX_WORDS = 200_000  # the word cache is dropped when it grows past this

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.context_length = tokenizer.context_length
        self.words: dict[str, list[int]] = {}

    def clean(self, text: str) -> str:
        if _PLAIN.fullmatch(text):
            return " ".join(text.split()).lower()  # basic_clean is the identity here
        return self.tokenizer.clean_fn(text)

    def encode(self, text: str) -> list[int]:
        tok, words, ids = self.tokenizer, self.words, []
        for word in tok.pat.findall(self.clean(text)):
            found = words.get(word)
            if found is None:
                if len(words) >= self.MAX_WORDS:
                    words.clear()
                unicode = "".join(tok.byte_encoder[b] for b in word.encode("utf-8"))
                found = words[word] = [tok.encoder[t] for t in tok.bpe(unicode).split(" ")]
            ids += found
        return ids

    def __call__(self, texts, context_length: int | None = None) -> torch.Tensor:
        texts = [texts] if isinstance(texts, str) else texts
        length = context_length or self.context_length
        sot, eot = self.tokenizer.sot_token_id, self.tokenizer.eot_token_id
        out = np.zeros((len(texts), length), dtype=np.int64)
        for i, text in enumerate(texts):
            ids = [sot] + self.encode(text) + [eot]
            if len(ids) > length:
                ids = ids[:length]
                ids[-1] = eot
            out[i, :len(ids)] = ids
        return torch.from_numpy(out)


def fast_tokenizer(tokenize: Callable) -> Callable:
    """``FastClipTokenizer(tokenize)`` for an open_clip SimpleTokenizer with its default cleaning
    and no reduction, else ``tokenize`` itself."""
    module = sys.modules.get("open_clip.tokenizer")  # not loaded: tokenize is no SimpleTokenizer
    if module is not None and type(tokenize) is module.SimpleTokenizer and \
            tokenize.clean_fn is module._clean_lower and tokenize.reduction_fn is None:
        return FastClipTokenizer(tokenize)
    return tokenize
