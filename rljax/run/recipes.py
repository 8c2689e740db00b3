"""Named TPU recipes of an experiment: a model, a Cloud TPU slice and the settings that make
the run fit it (mesh, micro-batch, remat), selected with `--set recipe=NAME`.

An experiment file that offers recipes defines `RECIPES: dict[str, Recipe]` and a hook
`recipe(cfg) -> ExperimentConfig` (usually `apply_recipe(cfg, RECIPES[cfg.recipe])`);
`rljax.run.experiment_files.load_experiment` calls the hook when `recipe` is set, before
`smoke`. `experiments/memory_budget.py` compiles each recipe's programs ahead of time for
its slice (`TpuSlice.topology`) from the model shapes in `MODEL_SHAPES`, without weights.

Every recipe scans its layers (`ModelConfig.scan_layers`): the recipes' models have 24-32
layers, where one scanned layer body compiles in the time of one layer (a Python loop
compiles each layer again: 7-8 minutes per learning program of a 0.5B / 1.5B model on a
2-core host), and the backward keeps one `[L, ...]` stack of each layer's input under
remat "full".
"""

from __future__ import annotations

import dataclasses
import os

from rljax.models import ModelConfig
from rljax.models.lora import LoraConfig
from rljax.sharding import MeshConfig

__all__ = ["MODEL_SHAPES", "SLICES", "Recipe", "TpuSlice", "apply_recipe"]


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A Cloud TPU slice: `topology` as `jax.experimental.topologies.get_topology_desc`
    names it, its number of chips (JAX devices), each chip's HBM in GiB, and one host's
    chips (`host_bounds`, libtpu's `chips_per_host_bounds`) where a VM holds more than
    libtpu's default 2x2 (v5litepod-8 is one host of 2x4 chips). `num_slices` > 1: a
    multislice job of that many such slices joined over DCN (`chips` counts them all);
    the mesh's data axis splits over the slices (`rljax.sharding.layout`)."""

    name: str
    topology: str
    chips: int
    hbm_gib: float
    host_bounds: tuple[int, int, int] | None = None
    num_slices: int = 1

    def topology_kwargs(self) -> dict:
        """Keyword arguments of `get_topology_desc` that describe the slice's hosts as a
        run sees them (so ahead-of-time compiles lay the mesh out as a run does)."""
        out = {} if self.host_bounds is None else {
            "chips_per_host_bounds": list(self.host_bounds)}
        return out | ({"num_slices": self.num_slices} if self.num_slices > 1 else {})


# Cloud TPU names count chips for v5e and TensorCores for v4 / v5p (two per chip).
SLICES = {s.name: s for s in (
    TpuSlice("v5e-4", "v5e:2x2", 4, 16.0),
    TpuSlice("v5e-8", "v5e:2x4", 8, 16.0, host_bounds=(2, 4, 1)),
    TpuSlice("v5e-16", "v5e:4x4", 16, 16.0),
    TpuSlice("v5e-64", "v5e:8x8", 64, 16.0),
    TpuSlice("v5e-16x2", "v5e:4x4", 32, 16.0, num_slices=2),  # 2 x v5litepod-16 over DCN
    TpuSlice("v5p-64", "v5p:2x4x4", 32, 95.0),
)}

# The public config.json values of the checkpoints the recipes name (Hugging Face hub:
# Qwen/Qwen2.5-0.5B-Instruct, Qwen/Qwen2.5-1.5B-Instruct, meta-llama/Meta-Llama-3-8B-
# Instruct): what the budget compiles without downloading weights.
MODEL_SHAPES = {
    "Qwen2.5-0.5B-Instruct": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768,
        architecture="qwen2"),
    "Qwen2.5-1.5B-Instruct": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768,
        architecture="qwen2"),
    "Meta-Llama-3-8B-Instruct": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, rope_theta=500_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, max_position_embeddings=8192, architecture="llama"),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One model on one slice.

    model: a key of `MODEL_SHAPES`; the checkpoint is read from `~/models/<model>`.
    slice: a key of `SLICES`.
    mesh: the mesh over the slice's chips (its product is the slice's chip count).
    micro_batch_size: completions per micro-batch of the learning program (0 = whole
      minibatch); a multiple of mesh data x fsdp.
    scan_layers: stacked `[L, ...]` layers run as one scan (`ModelConfig.scan_layers`).
    remat: what each layer keeps for the backward pass (`ModelConfig.remat`: "full" keeps
      only its input, "dots_saveable" also its matmul outputs, "none" everything).
    logp_chunk: positions per chunk of the output projection (`RLConfig.logp_chunk`).
    attention: `ModelConfig.attention` of the loaded model ("splash" on TPU).
    lora: the run's adapters (`ExperimentConfig.lora`), or None for a full-parameter
      recipe; with them the base is frozen in the compute dtype and the KL reference is
      the base (no copy). Set `optim.lr` for LoRA (it usually wants ~10x a full run's).
    tokens_per_micro_batch: > 0 packs the learning batch (`RLConfig.tokens_per_micro_batch`;
      `micro_batch_size` must then be 0).
    why: one line on the choices, printed by the budget.
    """

    model: str
    slice: str
    mesh: MeshConfig
    micro_batch_size: int
    scan_layers: bool = True
    remat: str = "full"
    logp_chunk: int = 128
    attention: str = "splash"
    lora: LoraConfig | None = None
    tokens_per_micro_batch: int = 0
    why: str = ""

    def __post_init__(self):
        if self.model not in MODEL_SHAPES:
            raise ValueError(f"Recipe.model={self.model!r}; allowed: {sorted(MODEL_SHAPES)}")
        if self.slice not in SLICES:
            raise ValueError(f"Recipe.slice={self.slice!r}; allowed: {sorted(SLICES)}")
        self.mesh.resolve(SLICES[self.slice].chips)  # raises unless it covers the chips

    @property
    def tpu(self) -> TpuSlice:
        """The slice this recipe runs on."""
        return SLICES[self.slice]

    def model_config(self, compute_dtype: str = "bfloat16") -> ModelConfig:
        """The model's shapes with this recipe's attention and `compute_dtype`."""
        return dataclasses.replace(MODEL_SHAPES[self.model], attention=self.attention,
                                   compute_dtype=compute_dtype, scan_layers=self.scan_layers,
                                   remat=self.remat)


def apply_recipe(cfg, recipe: Recipe, models_dir: str = "~/models"):
    """`cfg` (an `ExperimentConfig`) with `recipe`'s checkpoint, mesh, micro-batch, layer
    layout, remat, chunk, attention and, when it names them, adapters."""
    return dataclasses.replace(
        cfg, hf_path=os.path.join(os.path.expanduser(models_dir), recipe.model),
        lora=cfg.lora if recipe.lora is None else recipe.lora,
        attention=recipe.attention, scan_layers=recipe.scan_layers, remat=recipe.remat,
        mesh=recipe.mesh,
        algorithm=dataclasses.replace(cfg.algorithm, micro_batch_size=recipe.micro_batch_size),
        rl=dataclasses.replace(cfg.rl, remat=recipe.remat != "none",
                               logp_chunk=recipe.logp_chunk,
                               tokens_per_micro_batch=recipe.tokens_per_micro_batch))
