"""The 2-conv CNN of issue 49 in JAX, batch 8 at 3x32x32, NCHW: conv 3->16 (3x3, pad 1), ReLU,
2x2 max pooling, conv 16->32 (3x3, pad 1), ReLU, adaptive average pooling to 4x4, linear 512->10.
The twin of tpuc's graphs for `bench/bench_backward.py`'s model. `build(sharding, train)` returns
(function, abstract arguments): the logits, or with `train` the gradient of their sum."""

import jax
import jax.numpy as jnp

BATCH, SIZE = 8, 32


def conv(x, w, b):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def forward(p, x):
    x = jax.nn.relu(conv(x, p["w1"], p["b1"]))
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    x = jax.nn.relu(conv(x, p["w2"], p["b2"]))
    n, c, h, w = x.shape
    x = x.reshape(n, c, 4, h // 4, 4, w // 4).mean((3, 5))  # adaptive pooling to 4x4
    return x.reshape(n, -1) @ p["fc_w"].T + p["fc_b"]


def build(sharding, train=False):
    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    params = {
        "w1": sd(16, 3, 3, 3),
        "b1": sd(16),
        "w2": sd(32, 16, 3, 3),
        "b2": sd(32),
        "fc_w": sd(10, 32 * 16),
        "fc_b": sd(10),
    }
    x = sd(BATCH, 3, SIZE, SIZE)
    if train:
        return jax.grad(lambda p, x: forward(p, x).sum()), (params, x)
    return forward, (params, x)
