"""Where is the signal? The fraction of GRPO groups whose rewards are mixed.

GRPO normalises rewards within a group (DeepSeekMath section 4.1.2); a group whose rewards
are all equal gets advantage exactly 0 and gives no gradient. With binary rewards of
success rate p and groups of G = 8 independent samples, a group is mixed unless all G
succeed or all G fail:

    P(mixed) = 1 - p^G - (1 - p)^G,

which is 0 at p = 0, 0.992 at p = 0.5 and 0.337 at p = 0.95 (the seed rounds to 0, 0.99,
0.34). We check it by simulation: Bernoulli(p) rewards, grouped consecutively, and
`rljax.objectives.zero_variance_fraction` counts the groups without signal. Each of
`--seeds` independent seeds simulates `--groups` groups per rate; the table reports the
pooled fraction and its standard error across seeds.

Run: `python experiments/signal_fraction.py [--seeds 20] [--out experiments/out/]`.
The last line is `RESULT key=value ...`.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rljax.objectives import zero_variance_fraction
from rljax.run import result_line

GROUP = 8
NAMED_RATES = (0.0, 0.5, 0.95)


def analytic_signal_fraction(p, group_size: int = GROUP):
    """P(a group of `group_size` Bernoulli(p) rewards is not all equal) = 1 - p^G - (1-p)^G."""
    p = np.asarray(p, np.float64)
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def simulated_signal_count(key, p, n_groups: int, group_size: int = GROUP):
    """Number of groups with mixed rewards among `n_groups` simulated ones (one seed).

    Returned as a count (float32, exact up to 2^24 groups): the library's fraction times
    n_groups, rounded, so that 1 - fraction carries no float32 rounding residue."""
    rewards = jax.random.bernoulli(key, p, (n_groups * group_size,)).astype(jnp.float32)
    return n_groups - jnp.round(zero_variance_fraction(rewards, group_size) * n_groups)


def simulate_rates(key, rates_R, *, n_seeds: int, n_groups: int, group_size: int = GROUP):
    """Signal fraction per (rate, seed), shape [R, n_seeds], as float64 numpy: mixed-group
    counts from `_simulate_counts` divided by n_groups."""
    counts = _simulate_counts(key, rates_R, n_seeds=n_seeds, n_groups=n_groups, group_size=group_size)
    return np.asarray(counts, np.float64) / n_groups


@functools.partial(jax.jit, static_argnames=("n_seeds", "n_groups", "group_size"))
def _simulate_counts(key, rates_R, *, n_seeds: int, n_groups: int, group_size: int = GROUP):
    """Mixed-group counts per (rate, seed), shape [R, n_seeds]. Rates run one after the other
    (lax.map) so memory stays at one rate's rewards."""
    keys_R = jax.random.split(key, rates_R.shape[0])

    def one_rate(args):
        k, p = args
        seed_keys = jax.random.split(k, n_seeds)
        sim = functools.partial(simulated_signal_count, n_groups=n_groups, group_size=group_size)
        return jax.vmap(sim, in_axes=(0, None))(seed_keys, p)

    return jax.lax.map(one_rate, (keys_R, rates_R))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="independent simulations per rate")
    p.add_argument("--groups", type=int, default=5_000, help="groups per seed and rate")
    p.add_argument("--seed", type=int, default=0, help="base PRNG seed")
    p.add_argument("--rates", type=int, default=101, help="points of the curve over [0, 1]")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/out"))
    args = p.parse_args(argv)
    for name, low in (("seeds", 1), ("groups", 1), ("rates", 2)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    return args


def _plot(path, curve_rates, curve_sim, named_sim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fine = np.linspace(0.0, 1.0, 501)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(fine, analytic_signal_fraction(fine), label=r"analytic $1-p^8-(1-p)^8$")
    ax.plot(curve_rates, curve_sim, ".", ms=4, label="simulated")
    for p, s, off in zip(NAMED_RATES, named_sim, ((6, 6), (-30, -16), (-110, -4))):
        ax.annotate(f"p={p}: {s:.3f}", (p, s), textcoords="offset points", xytext=off)
    ax.plot(NAMED_RATES, named_sim, "o", mfc="none", color="k", label="seed's three prompts")
    ax.set_xlabel("success rate p of the prompt")
    ax.set_ylabel("fraction of groups with signal")
    ax.set_title(f"GRPO groups of {GROUP}: where is the signal?")
    ax.set_ylim(-0.02, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict[str, float]:
    """Print the table, write `signal_fraction.png` into --out, print the RESULT line and
    return its values as a dict."""
    args = _parse(argv)
    key_named, key_curve = jax.random.split(jax.random.key(args.seed))
    sim = functools.partial(simulate_rates, n_seeds=args.seeds, n_groups=args.groups)
    named = np.asarray(sim(key_named, jnp.asarray(NAMED_RATES, jnp.float32)), np.float64)
    rates = np.linspace(0.0, 1.0, args.rates)
    curve = np.asarray(sim(key_curve, jnp.asarray(rates, jnp.float32)), np.float64)

    n_total = args.seeds * args.groups
    print(f"Groups of {GROUP}, {args.seeds} seeds x {args.groups} groups = {n_total} groups per rate")
    print(f"{'success rate':>12} {'analytic':>9} {'simulated':>10} {'SE':>8} {'|err|':>8}")
    named_mean = named.mean(1)
    se = named.std(1, ddof=1) / np.sqrt(args.seeds) if args.seeds > 1 else np.full(3, np.nan)
    exact = analytic_signal_fraction(NAMED_RATES)
    for p, a, s, e in zip(NAMED_RATES, exact, named_mean, se):
        print(f"{p:>12.2f} {a:>9.4f} {s:>10.4f} {e:>8.4f} {abs(s - a):>8.4f}")
    curve_mean = curve.mean(1)
    curve_err = np.abs(curve_mean - analytic_signal_fraction(rates))
    # Binomial SE of the pooled fraction, from the analytic value (0 at p = 0 and 1).
    exact_curve = analytic_signal_fraction(rates)
    curve_se = np.sqrt(exact_curve * (1 - exact_curve) / n_total)
    z = np.divide(curve_err, curve_se, out=np.zeros_like(curve_err), where=curve_se > 0)
    print(f"curve over {args.rates} rates in [0, 1]: max |simulated - analytic| = {curve_err.max():.4f} "
          f"at p = {rates[np.argmax(curve_err)]:.2f}; largest in binomial SE units: {z.max():.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    plot_path = args.out / "signal_fraction.png"
    _plot(plot_path, rates, curve_mean, named_mean)
    print(f"plot: {plot_path}")

    result = {
        "signal_p0": named_mean[0], "signal_p05": named_mean[1], "signal_p095": named_mean[2],
        "exact_p0": exact[0], "exact_p05": exact[1], "exact_p095": exact[2],
        "max_abs_err": max(curve_err.max(), np.abs(named_mean - exact).max()),
        "groups_per_rate": n_total,
    }
    result = {k: float(v) for k, v in result.items()}
    print(result_line(result))
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
