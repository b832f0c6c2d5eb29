"""GPT-2 (124M config) forward at 1x128 in JAX: the twin of tpuc's graph for
`transformers.GPT2LMHeadModel(GPT2Config())` on `input_ids` of shape (1, 128), eval, no cache.
`build()` returns (function, abstract arguments) for `compare.py`."""

import jax
import jax.numpy as jnp

L, D, H, V, T, P = 12, 768, 12, 50257, 128, 1024


def ln(x, p):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * p[0] + p[1]


def fwd(params, ids):
    x = params["wte"][ids] + params["wpe"][: ids.shape[1]]
    mask = jnp.tril(jnp.ones((T, T), bool))
    for b in params["blocks"]:
        h = ln(x, b["ln1"]) @ b["attn_w"] + b["attn_b"]
        q, k, v = jnp.split(h, 3, -1)
        q, k, v = (t.reshape(1, T, H, D // H).transpose(0, 2, 1, 3) for t in (q, k, v))
        s = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(D // H), -jnp.inf)
        a = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(1, T, D)
        x = x + a @ b["proj_w"] + b["proj_b"]
        x = (
            x
            + jax.nn.gelu(ln(x, b["ln2"]) @ b["fc_w"] + b["fc_b"], approximate=True) @ b["out_w"]
            + b["out_b"]
        )
    return ln(x, params["lnf"]) @ params["wte"].T


def build(sharding):
    def sd(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = {
        "wte": sd(V, D),
        "wpe": sd(P, D),
        "lnf": (sd(D), sd(D)),
        "blocks": [
            {
                "ln1": (sd(D), sd(D)),
                "attn_w": sd(D, 3 * D),
                "attn_b": sd(3 * D),
                "proj_w": sd(D, D),
                "proj_b": sd(D),
                "ln2": (sd(D), sd(D)),
                "fc_w": sd(D, 4 * D),
                "fc_b": sd(4 * D),
                "out_w": sd(4 * D, D),
                "out_b": sd(D),
            }
            for _ in range(L)
        ],
    }
    return fwd, (params, sd(1, T, dtype=jnp.int32))
