"""vlp.data.tokens: the fast wrapper gives open_clip's ids exactly, on plain and awkward captions."""

import random

import open_clip
import torch

from vlp.data.tokens import FastClipTokenizer, fast_tokenizer

TOK = open_clip.get_tokenizer("ViT-B-32")

AWKWARD = [
    "", "   ", "A photo of a DOG.", "tab\tand\nnewline", "carriage\r\nreturn", "ctrl\x1cchar", "bell\x07",
    "fish &amp; chips", "&lt;b&gt;bold&lt;/b&gt;", "a &amp;amp; b", "<b>html</b> & co", "caf\u00e9 na\u00efve",
    "\u201ccurly\u201d quotes", "\ufb01ligature", "\uff21\uff22 fullwidth", "mojibake \u00c3\u00a9", "emoji \U0001F600",
    "nbsp\u00a0space", "line\u2028sep", "<start_of_text> literal", "it's we're I'd", "numbers 12345 x2",
    "word " * 100, "\x00nul", "del\x7f", "\x0bvt\x0cff",
]


def test_same_ids_as_open_clip():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x20, 0x7f)] + ["\t", "\n", "\r", "\x1c", "\u00e9", "&", "\u201c"]
    texts = AWKWARD + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(400)]
    fast = fast_tokenizer(TOK)
    assert isinstance(fast, FastClipTokenizer)
    assert torch.equal(fast(texts), TOK(texts))
    assert torch.equal(fast(texts), TOK(texts))  # a second pass: from the word cache
    assert torch.equal(fast(texts, context_length=16), TOK(texts, context_length=16))
    assert fast(texts).dtype == torch.long and torch.equal(fast("one caption"), TOK("one caption"))


def test_other_tokenizers_pass_through():
    def tokenize(texts):
        return torch.zeros(len(texts), 4, dtype=torch.long)

    assert fast_tokenizer(tokenize) is tokenize
    canon = open_clip.tokenizer.SimpleTokenizer(clean="canonicalize")
    assert fast_tokenizer(canon) is canon
