"""rljax.kernels: hand-written kernels for hot spots XLA's own code leaves slow.

- :mod:`rljax.kernels.cpu_matmul`: small-batch matmuls against pre-packed float32
  weights on x86-64 CPUs with AVX2 (an XLA FFI call), used by the sampler's decode step,
  and the softmax block sums of its vocab-major head.
- :mod:`rljax.kernels.cpu_build`: builds the C++ sources on first use and says whether
  they can run (:func:`~rljax.kernels.cpu_build.available`).

Imports nothing from the rest of rljax (it sits below ``rljax.models``).
"""
