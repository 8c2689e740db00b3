"""MoE test helpers shared by tests/test_moe.py and tests/test_moe_rl.py."""

import jax


def near_tied(model, eps):
    """``model`` with every expert's router column the first one's plus ``eps``-relative
    noise: router logits tied to float32 rounding, so top-k follows summation order
    (stacked layers: the router is ``[L, D, E]``)."""
    w = model.layers.mlp.router[...]
    noise = jax.random.normal(jax.random.key(11), w.shape)
    model.layers.mlp.router[...] = w[..., :1] * (1 + eps * noise)
    return model
