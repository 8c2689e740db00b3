"""rljax: JAX-native reinforcement-learning post-training of language models.

Layers (lower never imports higher; `lint-imports` checks the contracts in pyproject.toml):
objectives -> sharding -> models -> sampling -> rewards / data (independent leaves) ->
envs (host-side environments) -> train (trainer core) -> run (experiments, runs) -> cli.
See the README for the entry points.
"""

__version__ = "0.1.0"
