"""The reference models every layer of tpuc is checked against (tests, example, benchmark)."""

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Two linear layers with ReLU."""

    def __init__(self, d_in=32, d_hidden=64, d_out=16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block: causal SDPA attention and a GELU MLP."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PostLNBlock(nn.Module):
    """Post-LayerNorm transformer block built on nn.MultiheadAttention."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        x = self.ln1(x + self.attn(x, x, x, need_weights=False)[0])
        return self.ln2(x + self.ff(x))


class ConvNet(nn.Module):
    """Conv2d, BatchNorm2d (eval), ReLU, MaxPool2d, flatten, Linear."""

    def __init__(self, channels=8, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, stride=1, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


def make(name, dtype=torch.float32, batch=2, seed=0):
    """Returns (model in eval mode, example inputs) for one of the reference models."""
    torch.manual_seed(seed)
    if name == "mlp":
        model, x = MLP(), torch.randn(batch, 32)
    elif name == "preln":
        model, x = PreLNBlock(), torch.randn(batch, 8, 64)
    elif name == "postln":
        model, x = PostLNBlock(), torch.randn(batch, 8, 64)
    elif name == "convnet":
        model, x = ConvNet(), torch.randn(batch, 3, 16, 16)
        # Non-trivial running stats, so eval-mode BatchNorm is not an identity.
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.eval().to(dtype), (x.to(dtype),)


NAMES = ["mlp", "preln", "postln", "convnet"]
