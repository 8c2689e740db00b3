"""rljax: JAX-native reinforcement-learning post-training of language models.

Layers (lower never imports higher): objectives -> sharding -> models -> sampling ->
rewards/data -> train -> cli. See the README for the public entry points.
"""

__version__ = "0.1.0"
