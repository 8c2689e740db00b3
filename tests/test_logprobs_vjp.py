"""The linear head's hand-written backward (rljax.train.learn.logprobs.linear_logprobs) equals
jax.grad of the plain formula: log-probs and entropies of softmax(h . W / temperature),
tied (``W [V, D]``) and untied (``W [D, V]``) heads, chunks over time, entropy
differentiated or not, and through ``policy_logprobs`` on every decoder parameter; with the
vocabulary sharded, the forward's target gather keeps it sharded."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from _train_common import random_seqs, tiny_model
from rljax.train.learn.logprobs import (chunked_logprobs, head_logits, linear_logprobs,
                                        policy_logprobs)


def _reference(w, h, tgt, *, vocab_major, temperature):
    """log p(target) and entropy from full float32 logits, differentiated by JAX."""
    spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
    lp = jax.nn.log_softmax(jnp.einsum(spec, h, w) / temperature)
    logp = jnp.take_along_axis(lp, tgt[..., None], -1)[..., 0]
    return logp, -jnp.sum(jnp.exp(lp) * lp, -1)


@pytest.mark.parametrize("vocab_major", [True, False])
def test_linear_logprobs_gradient_equals_autodiff(vocab_major):
    rng = np.random.default_rng(0)
    b, t, d, v = 3, 7, 16, 50
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(0.5 * rng.normal(size=(v, d) if vocab_major else (d, v)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    a = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def loss(fn, w, h, with_logp, with_ent):
        logp, ent = fn(w, h)
        return (jnp.sum(a * logp) if with_logp else 0.0) + (jnp.sum(e * ent) if with_ent else 0.0)

    @functools.partial(jax.jit, static_argnums=(2, 3, 4))
    def both(w, h, chunk, temperature, terms):
        ref = functools.partial(_reference, tgt=tgt, vocab_major=vocab_major,
                                temperature=temperature)
        new = functools.partial(linear_logprobs, targets_BxT=tgt, vocab_major=vocab_major,
                                chunk=chunk, temperature=temperature)
        grads = [jax.grad(functools.partial(loss, f), (0, 1))(w, h, *terms) for f in (ref, new)]
        return ref(w, h), new(w, h), grads

    for chunk, temperature, terms in [(3, 0.7, (True, False)), (7, 1.0, (True, True)),
                                      (64, 0.7, (True, True)), (2, 1.3, (False, True))]:
        (lp0, ent0), (lp1, ent1), (g0, g1) = both(w, h, chunk, temperature, terms)
        np.testing.assert_allclose(lp1, lp0, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent1, ent0, rtol=1e-5, atol=1e-5)
        for x, y in zip(g1, g0):  # dW, dh
            assert x.shape == y.shape and x.dtype == y.dtype
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_policy_logprobs_gradient_equals_autodiff_of_the_head(tied):
    """Every decoder parameter's gradient (the tied embedding gets both the lookup's and
    the head's) equals autodiff of the generic chunked path."""
    gd, st = tiny_model(tie_word_embeddings=tied, num_layers=1)
    seqs = random_seqs(np.random.default_rng(1), 4, 3, 6)
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)

    def generic(p, s, chunk, temperature):  # the pre-custom-VJP path, plain autodiff
        from rljax.train.learn.logprobs import completion_hidden
        from flax import nnx
        h = completion_hidden(nnx.merge(gd, p), s["prompt_BxP"], s["prompt_mask_BxP"],
                              s["completion_BxT"], s["completion_mask_BxT"])
        return chunked_logprobs(head_logits(gd), p, h, s["completion_BxT"].astype(jnp.int32),
                                chunk=chunk, temperature=temperature)

    def loss(fn, p):
        logp, ent = fn(p, seqs, 4, 0.8)
        return jnp.sum(a * logp) + jnp.sum(e * ent)

    new = lambda p, s, c, tmp: policy_logprobs(gd, p, s, chunk=c, temperature=tmp)  # noqa: E731
    g_ref, g_new = jax.jit(lambda p: (jax.grad(functools.partial(loss, generic))(p),
                                      jax.grad(functools.partial(loss, new))(p)))(st)
    leaves_ref, leaves_new = jax.tree.leaves(g_ref), jax.tree.leaves(g_new)
    assert len(leaves_ref) == len(leaves_new)
    for x, y in zip(leaves_new, leaves_ref):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _dots(fn, *args) -> int:
    """dot_general ops in ``fn``'s lowered program (before XLA's own dead-code removal)."""
    return jax.jit(fn).lower(*args).as_text().count("dot_general")


def test_frozen_head_forms_no_weight_gradient():
    """A head weight that is not differentiated (LoRA's frozen base) gets no dW: the
    backward's program has one matmul fewer than the trained head's (the control), with
    dh unchanged; through a LoRA decoder the adapters' gradients equal autodiff of the
    generic chunked path."""
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(size=(2, 6, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(40, 8)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 40, (2, 6)), jnp.int32)

    def loss(w, h):
        logp, ent = linear_logprobs(w, h, tgt, vocab_major=True, chunk=2)
        return jnp.sum(logp * h[..., 0]) + jnp.sum(ent)

    frozen, trained = jax.grad(lambda h: loss(w, h)), jax.grad(loss, (0, 1))
    np.testing.assert_array_equal(frozen(h), trained(w, h)[1])
    # forward logits, the backward's recomputed logits and dh; dW only when trained
    assert (_dots(frozen, h), _dots(trained, w, h)) == (3, 4)

    from flax import nnx

    from rljax.models.lora import LoraConfig, merge_trainable, split_trainable
    from rljax.train.learn.logprobs import completion_hidden

    gd, st = tiny_model(lora=LoraConfig(rank=4, alpha=8.0), num_layers=1)
    st = jax.tree.map(lambda x: x + 0.1 * jnp.ones_like(x) if x.ndim else x, st)  # B != 0
    train, base = split_trainable(st)
    seqs = random_seqs(np.random.default_rng(4), 4, 3, 6)

    def generic(p):  # plain autodiff of the head, as before the custom VJP
        h = completion_hidden(nnx.merge(gd, p), seqs["prompt_BxP"], seqs["prompt_mask_BxP"],
                              seqs["completion_BxT"], seqs["completion_mask_BxT"])
        return chunked_logprobs(head_logits(gd), p, h, seqs["completion_BxT"].astype(jnp.int32),
                                chunk=4)

    def lora_loss(fn, t):
        logp, ent = fn(merge_trainable(t, base))
        return jnp.sum(logp) + 0.3 * jnp.sum(ent)

    new = lambda p: policy_logprobs(gd, p, seqs, chunk=4)  # noqa: E731
    g_ref, g_new = jax.jit(lambda t: [jax.grad(functools.partial(lora_loss, f))(t)
                                      for f in (generic, new)])(train)
    for x, y in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_linear_logprobs_rejects_bad_arguments():
    w = jnp.zeros((10, 4))
    h = jnp.zeros((2, 3, 4))
    tgt = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="chunk"):
        linear_logprobs(w, h, tgt, vocab_major=True, chunk=0)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(w, h, tgt, vocab_major=True, chunk=2, temperature=0.0)
    with pytest.raises(ValueError, match="weight shape"):
        linear_logprobs(w, h, tgt, vocab_major=False, chunk=2)


def _vocab_all_gathers(hlo: str, v: int) -> list[str]:
    """All-gathers in compiled HLO whose result has a dimension of size ``v``."""
    return [line.strip()[:120] for line in hlo.splitlines()
            if " all-gather(" in line and re.search(rf"\[[\d,]*\b{v}\b", line.split("=", 1)[1])]


@pytest.mark.parametrize("vocab_major", [True, False])
def test_vocab_sharded_logits_stay_sharded_through_the_target_gather(mesh8, vocab_major):
    """The target's logit is a gather along V; with W sharded over `tensor` on V, the
    compiled forward gathers on each shard (no all-gather of a vocab-sized array). The
    control replicates the logits first: the check then sees the all-gather."""
    b, t, d, v = 8, 4, 16, 256
    w_shape, w_spec = ((v, d), P("tensor", None)) if vocab_major else ((d, v), P(None, "tensor"))
    args = (jax.ShapeDtypeStruct(w_shape, jnp.float32, sharding=NamedSharding(mesh8, w_spec)),
            jax.ShapeDtypeStruct((b, t, d), jnp.float32,
                                 sharding=NamedSharding(mesh8, P(("data", "fsdp")))),
            jax.ShapeDtypeStruct((b, t), jnp.int32,
                                 sharding=NamedSharding(mesh8, P(("data", "fsdp")))))
    fn = functools.partial(linear_logprobs, vocab_major=vocab_major, chunk=t)
    hlo = jax.jit(lambda w, h, tgt: fn(w, h, tgt)[0]).lower(*args).compile().as_text()
    assert not _vocab_all_gathers(hlo, v), _vocab_all_gathers(hlo, v)

    def replicated(w, h, tgt):
        z = jnp.einsum("btd,vd->btv" if vocab_major else "btd,dv->btv", h, w)
        z = jax.lax.with_sharding_constraint(z, NamedSharding(mesh8, P()))
        return jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0]

    control = jax.jit(replicated).lower(*args).compile().as_text()
    assert _vocab_all_gathers(control, v), "the check finds no all-gather even in the control"
