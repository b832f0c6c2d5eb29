"""ResNet-18 (torchvision layout, 10 classes) in JAX at batch 2, 3x64x64, NCHW: the twin of tpuc's
graphs for `torchvision.models.resnet18(num_classes=10)`. `build(sharding, train)` returns
(function, abstract arguments): inference uses the running statistics (eval), training returns the
gradient of the summed logits with batch statistics (train mode). `build_split(sharding)`: the
same gradient as two programs, as AOTAutograd splits tpuc's training step (see its docs).
`build(sharding, step=True)`: one whole training step as `torch.optim.SGD(lr=0.1, momentum=0.9)`
runs it after its first step (loss = summed logits; gradients, momentum, parameters and
BatchNorm's running statistics and batch counts updated), with the parameters, the momentum
buffers and the BatchNorm buffers donated (`DONATE`), as `jax.jit(step, donate_argnums=DONATE)`."""

import functools

import jax
import jax.numpy as jnp

STAGES = [(64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)]


def conv(x, w, stride=1, pad=None):
    pad = w.shape[2] // 2 if pad is None else pad
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), [(pad, pad)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW")
    )


def bn(x, p, train, stats=None):
    if train:
        m, v = x.mean((0, 2, 3)), x.var((0, 2, 3))
        if stats is not None:  # the batch statistics a step folds into the running ones
            n = x.size // x.shape[1]
            stats.append((m, v * n / (n - 1)))
    else:
        m, v = p[2], p[3]
    return (x - m[None, :, None, None]) / jnp.sqrt(v[None, :, None, None] + 1e-5) * p[0][
        None, :, None, None
    ] + p[1][None, :, None, None]


def forward(params, x, train, stats=None):
    x = jax.nn.relu(bn(conv(x, params["stem"], 2, 3), params["bn"], train, stats))
    x = jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), [(0, 0), (0, 0), (1, 1), (1, 1)]
    )
    for b, (_, s) in zip(params["blocks"], STAGES, strict=True):
        y = jax.nn.relu(bn(conv(x, b["c1"], s), b["b1"], train, stats))
        y = bn(conv(y, b["c2"]), b["b2"], train, stats)
        sc = bn(conv(x, b["down"], s, 0), b["bd"], train, stats) if "down" in b else x
        x = jax.nn.relu(y + sc)
    return x.mean((2, 3)) @ params["fc_w"].T + params["fc_b"]


#: argument indices a step donates: its parameters, momentum buffers and BatchNorm buffers
DONATE = (0, 1, 2)
LR, MOMENTUM, BN_MOMENTUM = 0.1, 0.9, 0.1


def sgd_step(params, mom, bufs, x, grad_outputs=False):
    """One SGD step with momentum (torch.optim.SGD after its first step) and BatchNorm's
    running statistics updated: (loss, params, mom, bufs), and the gradients with
    `grad_outputs` (as tpuc's step returns them: eager's `p.grad` holds them after the step)."""

    def loss_fn(p):
        stats = []
        return forward(p, x, True, stats).sum(), stats

    (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    mom = jax.tree_util.tree_map(lambda m, g: MOMENTUM * m + g, mom, g)
    params = jax.tree_util.tree_map(lambda p, m: p - LR * m, params, mom)
    bufs = [
        ((1 - BN_MOMENTUM) * rm + BN_MOMENTUM * m, (1 - BN_MOMENTUM) * rv + BN_MOMENTUM * v, n + 1)
        for (rm, rv, n), (m, v) in zip(bufs, stats, strict=True)
    ]
    return (loss, params, mom, bufs, g) if grad_outputs else (loss, params, mom, bufs)


def build(sharding, train=False, step=False, grad_outputs=False):
    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    def bnp(c):
        # a step's parameters hold BatchNorm's weight and bias only; its buffers are apart
        return (sd(c), sd(c)) if step else (sd(c), sd(c), sd(c), sd(c))

    params = {"stem": sd(64, 3, 7, 7), "bn": bnp(64), "blocks": [], "fc_w": sd(10, 512), "fc_b": sd(10)}
    cin = 64
    for cout, s in STAGES:
        b = {"c1": sd(cout, cin, 3, 3), "b1": bnp(cout), "c2": sd(cout, cout, 3, 3), "b2": bnp(cout)}
        if s != 1 or cin != cout:
            b["down"], b["bd"] = sd(cout, cin, 1, 1), bnp(cout)
        params["blocks"].append(b)
        cin = cout
    x = sd(2, 3, 64, 64)
    if step:
        # (running mean, running var, batches tracked) per BatchNorm, in forward's order
        order = [64]
        for (c, _), b in zip(STAGES, params["blocks"], strict=True):
            order += [c, c] + ([c] if "down" in b else [])
        count = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
        bufs = [(sd(c), sd(c), count) for c in order]
        return functools.partial(sgd_step, grad_outputs=grad_outputs), (params, params, bufs, x)
    if train:
        return jax.grad(lambda p, x: forward(p, x, True).sum()), (params, x)
    return (lambda p, x: forward(p, x, False)), (params, x)


def build_split(sharding):
    """The training twin as two programs, the way tpuc's step is two executables: a forward
    returning the logits and the residuals `jax.vjp` saves (without the inputs among them: those
    the backward takes again, as tpuc's backward takes the weights), and a backward from them.
    Returns [(forward, args), (backward, args)]: what the split itself costs XLA:TPU, against
    `build(train=True)`'s one program."""
    grad, (params, x) = build(sharding, train=True)
    del grad
    found = {}

    def f(p, x):
        return forward(p, x, True)

    def fwd(p, x):
        out, vjp_fn = jax.vjp(f, p, x)
        leaves, tree = jax.tree_util.tree_flatten(vjp_fn)
        inputs = jax.tree_util.tree_leaves((p, x))
        found["tree"] = tree
        found["at"] = [next((i for i, a in enumerate(inputs) if a is leaf), None) for leaf in leaves]
        return out, [leaf for leaf, i in zip(leaves, found["at"], strict=True) if i is None]

    def bwd(p, x, saved, ct):
        inputs, rest = jax.tree_util.tree_leaves((p, x)), iter(saved)
        leaves = [inputs[i] if i is not None else next(rest) for i in found["at"]]
        return jax.tree_util.tree_unflatten(found["tree"], leaves)(ct)

    out, saved = jax.eval_shape(fwd, params, x)

    def place(s):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    saved = jax.tree_util.tree_map(place, saved)
    return [(fwd, (params, x)), (bwd, (params, x, saved, place(out)))]
