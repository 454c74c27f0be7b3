"""The source of a small user model, written into a workspace folder by the tests (it is data for
them: the trainer imports it from the workspace, never from tests/)."""

USER_MODEL = '''
"""A user's own tiny language model: token embedding, residual causal-mix blocks, a head."""
import torch
import torch.nn.functional as F
from torch import nn

from trainer.recipe import ModelRecipe, gpt2_init


class Mix(nn.Module):
    """x + W2 gelu(W1 [norm(x), norm(x) shifted one step back]): a causal bigram mixer."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(2 * width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.norm(x)
        prev = F.pad(h, (0, 0, 1, 0))[:, :-1]
        return x + self.proj(F.gelu(self.fc(torch.cat([h, prev], dim=-1))))


class Head(nn.Module):
    def __init__(self, width, vocab_size):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class TinyLM(ModelRecipe):
    kind = "tiny-lm"

    def __init__(self, *, vocab_size, width, depth):
        self.vocab_size, self.width, self.depth = vocab_size, width, depth
        self.n_layers = depth + 2

    def build_layer(self, index):
        if index == 0:
            return nn.Embedding(self.vocab_size, self.width)
        if index == self.n_layers - 1:
            return Head(self.width, self.vocab_size)
        return Mix(self.width)

    def init_layer(self, index, layer, *, generator):
        gpt2_init(layer, generator=generator, n_layers=self.depth)


def make(*, vocab_size, width=32, depth=2):
    return TinyLM(vocab_size=vocab_size, width=width, depth=depth)


def not_a_recipe(**kwargs):
    return nn.Linear(2, 2)


class Mismatched(TinyLM):
    def build_layer(self, index):
        if index == 1:
            return nn.Linear(self.width + 1, self.width)  # expects one feature too many
        return super().build_layer(index)


def mismatched(*, vocab_size):
    return Mismatched(vocab_size=vocab_size, width=16, depth=2)
'''


USER_CNN = '''
"""A user's tiny CNN classifying 8x8 images from their own python data (not tokens at all)."""
import torch
from torch import nn
from trainer.recipe import ModelRecipe, gpt2_init

def images(*, batch_size, seq_len, seed, n_classes=4):
    def stream(offset):
        g = torch.Generator().manual_seed(seed + offset)
        protos = torch.randn(n_classes, 1, 8, 8, generator=torch.Generator().manual_seed(123))
        while True:
            y = torch.randint(0, n_classes, (batch_size,), generator=g)
            x = protos[y] + 0.5 * torch.randn(batch_size, 1, 8, 8, generator=g)
            yield x, y
    return stream(0), stream(1)

class Conv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__(); self.conv = nn.Conv2d(cin, cout, 3, padding=1)
    def forward(self, x): return torch.relu(self.conv(x))

class Classify(nn.Module):
    def __init__(self, c, k):
        super().__init__(); self.fc = nn.Linear(c * 64, k)
    def forward(self, x): return self.fc(x.flatten(1))

class CNN(ModelRecipe):
    kind = "cnn"
    def __init__(self, width, n_classes):
        self.width, self.k = width, n_classes; self.n_layers = 3
    def build_layer(self, i):
        return [Conv(1, self.width), Conv(self.width, self.width), Classify(self.width, self.k)][i]
    def init_layer(self, i, layer, *, generator):
        gpt2_init(layer, generator=generator, n_layers=2)

def make(*, width=8, n_classes=4):
    return CNN(width, n_classes)
'''
