"""A byte-level language model of the Python documentation: a small decoder-only
transformer (GPT-style: causal self-attention, pre-norm blocks) on real English prose.

The corpus is `pydoc_data.topics` (the text of the language reference's topics that
`help()` shows: about 465 KB, in every CPython installation, so nothing is downloaded),
its topics joined in name order and read as UTF-8 bytes (256 token ids). The first 90% is
the training split, the rest the test split (split by position, not shuffled: the test
text is text the model never saw). A training item is a window of `context` bytes at any
position with the next byte of each as its target; the test split is cut into
non-overlapping windows.

    task: language_model
    model: {name: hetps.examples.charlm:model}
    data: {dataset: hetps.examples.charlm:datasets}
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCAB = 256  # bytes
TRAIN_SHARE = 0.9


def corpus() -> bytes:
    """The Python documentation's topics, joined in name order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


class Windows(Dataset):
    """(x, y) windows of `context` token ids, y = x shifted by one; a window starts every
    `stride` tokens."""

    def __init__(self, ids: torch.Tensor, context: int, stride: int):
        self.ids, self.context, self.stride = ids, context, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.stride
        return self.ids[s : s + self.context], self.ids[s + 1 : s + self.context + 1]


def datasets(context: int = 64, test_tokens: int = 16384):
    """(train, test): every window of the first 90% of the corpus, and non-overlapping
    windows over the first `test_tokens` bytes of the rest (0: all of it)."""
    ids = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    cut = int(len(ids) * TRAIN_SHARE)
    test = ids[cut:] if test_tokens <= 0 else ids[cut : cut + test_tokens + 1]
    return Windows(ids[:cut], context, 1), Windows(test, context, context)


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a final norm and a linear head:
    logits (B, T, vocab) for token ids (B, T)."""

    def __init__(self, vocab: int, context: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(
                f"a sequence of {t} tokens is longer than the context ({self.context})"
            )
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, prompt: str, tokens: int = 200, temperature: float = 0.8) -> str:
        """`prompt` continued by `tokens` sampled bytes (an eyeball check of a trained model)."""
        ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
        for _ in range(tokens):
            logits = self(ids[:, -self.context :])[:, -1] / temperature
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def model(
    context: int = 64, d_model: int = 64, layers: int = 2, heads: int = 4, vocab: int = VOCAB
) -> CharLM:
    """The model factory (model.kwargs are its arguments; `context` must match the data's)."""
    return CharLM(vocab, context, d_model, layers, heads)
