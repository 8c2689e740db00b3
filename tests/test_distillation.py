"""On-policy distillation (issue 21 part 5): the estimator against the exact reverse-KL
gradient by enumeration, teacher == student, and the trainer's wiring with a loaded
teacher. `check_objective` runs on `distill` in tests/test_objectives_recent.py, inside
the one conformance program shared by the objectives of issue 21.

The enumerable policy: tokens {a, b, EOS}, completions of at most 3 tokens (ending at
EOS or cut at 3), a tabular softmax per EOS-free prefix (7 prefixes, 15 completions).
The estimator's expected gradient, sum_y pi(y) grad L(y), is computed exactly by summing
over all 15 completions, so the only error is float32 rounding: gradients agree to
GRAD_RTOL of their norm.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import objectives as ro
from rljax.testing import default_batch

GRAD_RTOL = 1e-6  # float32 sums over 15 completions x 3 tokens; observed 1.2e-7
A, B_, EOS, T = 0, 1, 2, 3
PREFIXES = [()] + [p for n in (1, 2) for p in itertools.product((A, B_), repeat=n)]
INDEX = {p: i for i, p in enumerate(PREFIXES)}


def _completions() -> list[tuple[int, ...]]:
    """Every completion: under T EOS-free tokens then EOS, or T tokens (the last any)."""
    out = []
    for n in range(T - 1):
        out += [p + (EOS,) for p in itertools.product((A, B_), repeat=n)]
    out += [p + (x,) for p in itertools.product((A, B_), repeat=T - 1) for x in (A, B_, EOS)]
    return out


COMPLETIONS = _completions()
N = len(COMPLETIONS)
# [N, T] prefix index, token id and mask of every completion (padding: prefix 0, token 0).
PREFIX_NxT = np.array([[INDEX[y[:t]] if t < len(y) else 0 for t in range(T)] for y in COMPLETIONS])
TOKEN_NxT = np.array([[y[t] if t < len(y) else 0 for t in range(T)] for y in COMPLETIONS])
MASK_NxT = np.array([[float(t < len(y)) for t in range(T)] for y in COMPLETIONS], np.float32)


def _token_logp(logits_PxV, mask=MASK_NxT):
    """log pi(y_t | y_<t) of every completion's tokens, [N, T] (0 where masked)."""
    lp = jax.nn.log_softmax(logits_PxV)[PREFIX_NxT, TOKEN_NxT]
    return jnp.where(mask > 0, lp, 0.0)


@functools.partial(jax.jit, static_argnums=2)
def _estimator_expected_grad(theta, phi, discount):
    """sum_y pi(y) grad_theta L(y): the library objective on each completion alone."""
    def loss_of_row(th, n):
        logp = _token_logp(th)[n][None]
        batch = ro.ObjectiveBatch(
            logp_BxT=logp, old_logp_BxT=jax.lax.stop_gradient(logp),
            mask_BxT=jnp.asarray(MASK_NxT)[n][None], adv_BxT=jnp.zeros((1, T)),
            teacher_logp_BxT=_token_logp(phi)[n][None])
        loss_sum, count, _ = ro.distill(batch, ro.Coef(), discount=discount)
        return loss_sum / count

    grads_N = jax.vmap(jax.grad(loss_of_row), in_axes=(None, 0))(theta, jnp.arange(N))
    p_N = jnp.exp(_token_logp(theta).sum(axis=1))
    return jnp.einsum("n,npv->pv", p_N, grads_N), p_N.sum()


@functools.partial(jax.jit, static_argnums=2)
def _reverse_kl(theta, phi, hold_prefixes: bool):
    """sum over EOS-free prefixes h of P(h) KL(pi(.|h) || q(.|h)): the sequence-level
    reverse KL (chain rule); with ``hold_prefixes`` P(h) is held fixed (per-token KL)."""
    lp, lq = jax.nn.log_softmax(theta), jax.nn.log_softmax(phi)
    kl_P = jnp.sum(jnp.exp(lp) * (lp - lq), axis=1)
    reach_P = jnp.stack([jnp.exp(sum(lp[INDEX[h[:i]], h[i]] for i in range(len(h))))
                         if h else jnp.float32(1.0) for h in PREFIXES])
    if hold_prefixes:
        reach_P = jax.lax.stop_gradient(reach_P)
    return jnp.sum(reach_P * kl_P)


def _params(seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(0, 1.0, (len(PREFIXES), 3)), jnp.float32),
            jnp.asarray(rng.normal(0, 1.0, (len(PREFIXES), 3)), jnp.float32))


@pytest.mark.parametrize("discount, hold_prefixes", [(1.0, False), (0.0, True)])
def test_expected_gradient_is_the_exact_reverse_kl_gradient(discount, hold_prefixes):
    """discount 1: grad KL(pi || q) over whole completions; discount 0 (Thinking Machines):
    grad of the per-token reverse KLs with the student's prefix distribution held fixed."""
    theta, phi = _params(0)
    got, total_p = _estimator_expected_grad(theta, phi, discount)
    want = jax.grad(_reverse_kl)(theta, phi, hold_prefixes)
    assert abs(float(total_p) - 1.0) < 1e-6  # the enumeration covers every completion
    err = float(jnp.max(jnp.abs(got - want)))
    assert err <= GRAD_RTOL * float(jnp.linalg.norm(want)), (err, float(jnp.linalg.norm(want)))
    # The two targets differ, so each test tells the discounts apart.
    other = jax.grad(_reverse_kl)(theta, phi, not hold_prefixes)
    assert float(jnp.max(jnp.abs(other - want))) > 100 * GRAD_RTOL * float(jnp.linalg.norm(want))


def test_teacher_equal_to_student_gives_zero_loss_and_gradient():
    theta, phi = _params(1)
    for discount in (0.0, 1.0):
        # The teacher's log-probs are a second, separately fused log-softmax of the same
        # logits: equal up to float32 rounding (3e-9 seen on one CI machine), so the
        # expected gradient is zero to GRAD_RTOL of the gradient toward another teacher.
        got, _ = _estimator_expected_grad(theta, theta, discount)
        scale = float(jnp.linalg.norm(_estimator_expected_grad(theta, phi, discount)[0]))
        assert float(jnp.max(jnp.abs(got))) <= GRAD_RTOL * scale, (got, scale)
    b = default_batch(3, values=False)
    b = dataclasses.replace(b, teacher_logp_BxT=b.old_logp_BxT, adv_BxT=jnp.zeros_like(b.adv_BxT))

    def loss(logp):
        s, c, m = ro.distill(dataclasses.replace(b, logp_BxT=logp), ro.Coef(kl=0.0),
                             discount=0.5)
        return s / c, m

    # Identical log-prob arrays: the library's loss, gradient and metrics are exactly 0.
    (value, m), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(b.logp_BxT)
    assert float(value) == 0.0 and float(jnp.max(jnp.abs(g))) == 0.0
    assert float(m["teacher_kl"][0]) == 0.0 and float(m["teacher_kl_k3"][0]) == 0.0


def test_advantages_are_the_discounted_reverse_kl_to_go_and_inputs_are_checked():
    s = jnp.array([[-1.0, -2.0, -0.5, 9.0]])
    q = jnp.array([[-1.5, -1.0, -0.5, -7.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    k1 = np.array([0.5, -1.0, 0.0])
    for g in (0.0, 0.5, 1.0):
        want = [-(k1[t:] * g ** np.arange(3 - t)).sum() for t in range(3)] + [0.0]
        np.testing.assert_allclose(ro.distill_advantages(s, q, m, discount=g)[0], want, atol=1e-7)
    with pytest.raises(ValueError, match=r"discount=1\.5.*\[0, 1\]"):
        ro.distill_advantages(s, q, m, discount=1.5)
    with pytest.raises(ValueError, match="teacher_logp_BxT"):
        ro.distill(default_batch(0), ro.Coef())


def _save_hf(model, tok, path):
    from rljax.models import save_pretrained

    save_pretrained(model, path)
    tok.save_pretrained(str(path))
    return path


def test_trainer_runs_a_distillation_step_with_a_loaded_teacher(tmp_path):
    """The trainer's one learning program computes the teacher's log-probs (a teacher
    loaded from a Hugging Face folder, checked against the student's tokenizer): the
    step's update follows the teacher; a teacher equal to the student gives ~0 KL and
    gradient; a teacher with another tokenizer, or none, is refused with a clear error."""
    from flax import nnx

    from _train_common import tiny_config
    from rljax.models import Decoder, build_char_tokenizer
    from rljax.run.teacher import load_teacher
    from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
    from rljax.train.programs import CompileLog
    from rljax.train.rl import RLTrainer

    tok = build_char_tokenizer()
    cfg = tiny_config(vocab_size=len(tok), num_layers=1)
    student = Decoder(cfg, rngs=nnx.Rngs(0))
    teacher_dir = _save_hf(Decoder(cfg, rngs=nnx.Rngs(1)), tok, tmp_path / "teacher")
    self_dir = _save_hf(student, tok, tmp_path / "self")
    bad_dir = _save_hf(student, build_char_tokenizer("0123456789+="), tmp_path / "bad")
    with pytest.raises(ValueError, match=r"teacher '.*bad'.*tokenizer differs"):
        load_teacher(bad_dir, tok)
    gd, params = nnx.split(student)
    prompts = ["1+2=", "3+4=", "5+6=", "7+8="]
    source = lambda start, n: ([prompts[(start + i) % 4] for i in range(n)], [{}] * n)  # noqa: E731
    make = lambda teacher, name="distill": RLTrainer(  # noqa: E731
        gd, tok, lambda c, m: np.zeros(len(c), np.float32), algorithm=algorithm_preset(name),
        optim=OptimConfig(lr=1e-2), sampling=SamplingConfig(max_new_tokens=3),
        rl=RLConfig(steps=1, prompts_per_step=8, logp_chunk=4), prompt_len=6, teacher=teacher)
    with pytest.raises(ValueError, match="teacher=.*required for algorithm 'distill'"):
        make(None)
    with pytest.raises(ValueError, match="not allowed otherwise.*'grpo'"):
        make(load_teacher(teacher_dir, tok), "grpo")
    runs, trainers, learns = {}, [], []
    for name, path in (("other", teacher_dir), ("self", self_dir)):
        tr = make(load_teacher(path, tok))
        trainers.append(weakref.ref(tr))
        with CompileLog() as log:
            state, m = tr.step(tr.init_state(jax.tree.map(jnp.copy, params)), source)
        moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                    zip(jax.tree.leaves(state.params["policy"]), jax.tree.leaves(params)))
        runs[name] = (m, moved)
        learns.append(log.by_name()["jit(learn_step)"])
    # The second trainer ran the first one's compiled program (equal specs: JAX's cache,
    # rljax.train.programs.step), and that program does not keep the first trainer, nor
    # its teacher's parameters, alive.
    assert learns[1] == 0
    gc.collect()
    assert trainers[0]() is None and trainers[1]() is tr
    m, moved = runs["other"]
    assert m["teacher_kl_k3"] > 0.01 and m["grad_norm"] > 0 and moved > 0
    assert np.isfinite([m["loss"], m["teacher_kl"], m["teacher_logp"]]).all()
    m, _ = runs["self"]  # the same weights, scored by two programs: rounding only
    assert abs(m["teacher_kl"]) < 1e-5 and m["grad_norm"] < 1e-4 * runs["other"][0]["grad_norm"]
