"""Real architectures for the benchmarks, built here without downloading anything.

A model's gradients are what a user's step reduces: a few large matrices
and many small tensors (biases, norms). These networks have the parameter
shapes of the originals, so benchmarks reduce and train what users train:

  resnet50   torchvision's resnet50: 161 tensors, 25.6M parameters;
  bert       Hugging Face's BertForSequenceClassification over bert-base
             (2 classes): 201 tensors, 109.5M parameters;
  gpt2       Hugging Face's GPT2LMHeadModel, GPT-2 small (the head shares
             the token embedding): 148 tensors, 124.4M parameters.

``gradient_set(name)`` gives float32 arrays shaped like a model's
parameters, in the order backward produces their gradients (the last layer
first), built on PyTorch's meta device (no memory), or, for ``geometric``,
120 tensors of 64 MiB in all whose sizes grow geometrically from 8 KiB to
5 MiB (median 62 KiB, 82 under 256 KiB), the set issue 30 first measured.
"""

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional

SETS = ("resnet50", "bert", "gpt2", "geometric")


class Bottleneck(nn.Module):
    def __init__(self, inputs, width, stride):
        super().__init__()
        outputs = 4 * width
        self.layers = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(), nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut = nn.Identity() if stride == 1 and inputs == outputs else \
            nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                          nn.BatchNorm2d(outputs))

    def forward(self, x):
        return torch.relu(self.layers(x) + self.shortcut(x))


def resnet(blocks=(3, 4, 6, 3), classes=1000, base=64):
    """ResNet with bottleneck blocks: (3, 4, 6, 3) is ResNet-50 (25.6M parameters)."""
    layers = [nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    inputs = base
    for stage, count in enumerate(blocks):
        width = base * 2 ** stage
        for index in range(count):
            layers.append(Bottleneck(inputs, width, 2 if index == 0 and stage else 1))
            inputs = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)]
    return nn.Sequential(*layers)


def _attention(query, key, value, heads, causal):
    """Multi-head attention of (batch, tokens, hidden) projections."""
    batch, tokens, hidden = query.shape
    split = [t.view(batch, tokens, heads, hidden // heads).transpose(1, 2)
             for t in (query, key, value)]
    mixed = functional.scaled_dot_product_attention(*split, is_causal=causal)
    return mixed.transpose(1, 2).reshape(batch, tokens, hidden)


class BertLayer(nn.Module):
    """One encoder layer, its parameters registered in Hugging Face's order."""

    def __init__(self, hidden, heads, intermediate):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x):
        mixed = _attention(self.query(x), self.key(x), self.value(x), self.heads, False)
        x = self.attention_norm(x + self.attention_output(mixed))
        return self.output_norm(x + self.output(functional.gelu(self.intermediate(x))))


class Bert(nn.Module):
    """bert-base with a sequence classifier; forward takes (batch, tokens) ids."""

    def __init__(self, vocabulary=30522, positions=512, hidden=768, layers=12,
                 heads=12, intermediate=3072, classes=2):
        super().__init__()
        self.words = nn.Embedding(vocabulary, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.token_types = nn.Embedding(2, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(hidden, heads, intermediate)
                                    for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, ids):
        where = torch.arange(ids.shape[1], device=ids.device)
        x = self.embedding_norm(self.words(ids) + self.positions(where)
                                + self.token_types(torch.zeros_like(ids)))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


class Gpt2Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(hidden)
        self.attention = nn.Linear(hidden, 3 * hidden)
        self.projection = nn.Linear(hidden, hidden)
        self.norm_2 = nn.LayerNorm(hidden)
        self.expand = nn.Linear(hidden, 4 * hidden)
        self.contract = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        query, key, value = self.attention(self.norm_1(x)).chunk(3, dim=-1)
        x = x + self.projection(_attention(query, key, value, self.heads, True))
        return x + self.contract(functional.gelu(self.expand(self.norm_2(x)),
                                                 approximate="tanh"))


class Gpt2(nn.Module):
    """GPT-2 small with its language-model head (the token embedding, shared);
    forward takes (batch, tokens) ids and gives next-token logits."""

    def __init__(self, vocabulary=50257, positions=1024, hidden=768, layers=12, heads=12):
        super().__init__()
        self.words = nn.Embedding(vocabulary, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(Gpt2Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids):
        x = self.words(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.words.weight.t()


BUILDERS = {"resnet50": resnet, "bert": Bert, "gpt2": Gpt2}


def build(name):
    return BUILDERS[name]()


def parameter_shapes(name):
    """The shapes of a model's parameters, in registration order (no memory used)."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in build(name).parameters()]


def geometric_sizes(count=120, total=64 << 20, smallest=8 << 10, largest=5.15 * (1 << 20),
                    curve=1.665):
    """Byte counts growing from smallest to largest, faster towards the end
    (curve > 1), scaled to total: 8 KiB to 5 MiB, median 62 KiB by default."""
    steps = np.linspace(0, 1, count) ** curve
    sizes = smallest * (largest / smallest) ** steps
    sizes *= total / sizes.sum()
    floats = [max(1, int(size) // 4) for size in sizes]
    floats[-1] += total // 4 - sum(floats)
    return [n * 4 for n in floats]


def gradient_set(name):
    """float32 arrays of ones, one per gradient of the set, in the order
    backward produces them."""
    if name == "geometric":
        shapes = [(n // 4,) for n in geometric_sizes()]
    else:
        shapes = parameter_shapes(name)[::-1]
    return [np.ones(shape, np.float32) for shape in shapes]


def describe(arrays):
    """'161 tensors, 25.6M parameters (97.5 MiB), median 4 KiB'."""
    sizes = sorted(a.nbytes for a in arrays)
    median = sizes[len(sizes) // 2]
    return (f"{len(arrays)} tensors, {sum(a.size for a in arrays) / 1e6:.1f}M "
            f"parameters ({sum(sizes) / (1 << 20):.1f} MiB), median "
            f"{_bytes(median)}")


def _bytes(nbytes):
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else \
        f"{math.ceil(nbytes / 1024)} KiB"
