"""rljax.sharding: device meshes and the logical-axis -> mesh-axis rule table.

Layer 2: knows nothing of models. Parameters and batches name their dimensions
logically; `LOGICAL_RULES` maps those names to the mesh axes ("data", "fsdp", "tensor").
"""

from rljax.sharding.layout import check_process_blocks, device_grid, process_blocks
from rljax.sharding.mesh import (MESH_AXES, MeshConfig, OnMesh, make_mesh, mesh_context, mesh_of,
                                 on_mesh)
from rljax.sharding.placement import canonical_sharding, output_shardings, place_outputs, put_on
from rljax.sharding.rules import (
    BATCH_AXES,
    LOGICAL_RULES,
    batch_sharding,
    constrain_logical,
    constraints_enabled,
    fitted_spec,
    inference_shardings,
    logical_axes,
    logical_constraints,
    logical_sharding,
    logical_spec,
    replicated,
    shard_params,
    state_shardings,
)

__all__ = [
    "BATCH_AXES",
    "LOGICAL_RULES",
    "MESH_AXES",
    "MeshConfig",
    "OnMesh",
    "batch_sharding",
    "canonical_sharding",
    "output_shardings",
    "place_outputs",
    "put_on",
    "check_process_blocks",
    "constrain_logical",
    "constraints_enabled",
    "device_grid",
    "fitted_spec",
    "inference_shardings",
    "logical_axes",
    "logical_constraints",
    "logical_sharding",
    "logical_spec",
    "make_mesh",
    "mesh_of",
    "mesh_context",
    "on_mesh",
    "process_blocks",
    "replicated",
    "shard_params",
    "state_shardings",
]
