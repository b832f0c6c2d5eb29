"""GPT-2 (124M config) forward at 1x128 in JAX: the twin of tpuc's graph for
`transformers.GPT2LMHeadModel(GPT2Config())` on `input_ids` of shape (1, 128), eval, no cache.
`build()` returns (function, abstract arguments) for `compare.py`; `build(scan=True)` the same
network with its blocks stacked and run by `jax.lax.scan` (JAX's scan over layers: the block is
compiled once), and `build_parts()` one block and the rest alone, for `depth.py`.
`build(step=True, layers=N)`: one whole training step as `torch.optim.AdamW()` (defaults) runs it
after its first step, on the logits' mean square (bench/bench_real.py's loss), without dropout:
parameters, `exp_avg`, `exp_avg_sq` and the per-parameter `step` counters updated and donated
(`DONATE`), as `jax.jit(step, donate_argnums=DONATE)`."""

import functools

import jax
import jax.numpy as jnp

L, D, H, V, T, P = 12, 768, 12, 50257, 128, 1024


def ln(x, p):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * p[0] + p[1]


def block(x, b):
    mask = jnp.tril(jnp.ones((T, T), bool))
    h = ln(x, b["ln1"]) @ b["attn_w"] + b["attn_b"]
    q, k, v = jnp.split(h, 3, -1)
    q, k, v = (t.reshape(1, T, H, D // H).transpose(0, 2, 1, 3) for t in (q, k, v))
    s = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(D // H), -jnp.inf)
    a = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(1, T, D)
    x = x + a @ b["proj_w"] + b["proj_b"]
    return (
        x + jax.nn.gelu(ln(x, b["ln2"]) @ b["fc_w"] + b["fc_b"], approximate=True) @ b["out_w"] + b["out_b"]
    )


def embed(params, ids):
    return params["wte"][ids] + params["wpe"][: ids.shape[1]]


def head(params, x):
    return ln(x, params["lnf"]) @ params["wte"].T


#: argument indices a step donates: parameters, then AdamW's state (step, exp_avg, exp_avg_sq)
DONATE = (0, 1)
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 1e-2


def adamw_step(params, state, ids, grad_outputs=False):
    """One AdamW step (torch.optim.AdamW's defaults; per-parameter step counters, as its
    capturable form keeps them): (loss, params, state), and the gradients with `grad_outputs`."""
    loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.square(fwd(p, ids))))(params)
    step, m, v = state

    def update(p, g, t, m, v):
        t = t + 1
        p = p * (1 - LR * WEIGHT_DECAY)
        m = m + (g - m) * (1 - BETA1)
        v = BETA2 * v + (1 - BETA2) * g * g
        bc1, bc2 = 1 - BETA1**t, 1 - BETA2**t
        p = p - (LR / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + EPS)
        return p, t, m, v

    tree = jax.tree_util.tree_structure(params)
    out = [update(*a) for a in zip(*(tree.flatten_up_to(t) for t in (params, g, step, m, v)), strict=True)]
    params, step, m, v = (tree.unflatten(list(x)) for x in zip(*out, strict=True))
    return (loss, params, (step, m, v), g) if grad_outputs else (loss, params, (step, m, v))


def fwd(params, ids):
    x = embed(params, ids)
    for b in params["blocks"]:
        x = block(x, b)
    return head(params, x)


def scan_fwd(params, ids):
    x, _ = jax.lax.scan(lambda x, b: (block(x, b), None), embed(params, ids), params["blocks"])
    return head(params, x)


def _shapes(sharding):
    def sd(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def block_params(*lead):
        return {
            "ln1": (sd(*lead, D), sd(*lead, D)),
            "attn_w": sd(*lead, D, 3 * D),
            "attn_b": sd(*lead, 3 * D),
            "proj_w": sd(*lead, D, D),
            "proj_b": sd(*lead, D),
            "ln2": (sd(*lead, D), sd(*lead, D)),
            "fc_w": sd(*lead, D, 4 * D),
            "fc_b": sd(*lead, 4 * D),
            "out_w": sd(*lead, 4 * D, D),
            "out_b": sd(*lead, D),
        }

    rest = {"wte": sd(V, D), "wpe": sd(P, D), "lnf": (sd(D), sd(D))}
    return sd, block_params, rest


def build(sharding, scan=False, step=False, layers=L, grad_outputs=False):
    sd, block_params, rest = _shapes(sharding)
    ids = sd(1, T, dtype=jnp.int32)
    if step:
        params = {**rest, "blocks": [block_params() for _ in range(layers)]}
        counts = jax.tree_util.tree_map(lambda _: sd(), params)
        step_fn = functools.partial(adamw_step, grad_outputs=grad_outputs)
        return step_fn, (params, (counts, params, params), ids)
    if scan:
        return scan_fwd, ({**rest, "blocks": block_params(L)}, ids)
    return fwd, ({**rest, "blocks": [block_params() for _ in range(L)]}, ids)


def build_parts(sharding):
    """{"block": one block alone, "rest": embedding and head without blocks}: what compiling the
    network with its block compiled once cannot go below."""
    sd, block_params, rest = _shapes(sharding)
    return {
        "block": (block, (sd(1, T, D), block_params())),
        "rest": (lambda params, ids: head(params, embed(params, ids)), (rest, sd(1, T, dtype=jnp.int32))),
    }
