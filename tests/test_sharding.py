"""rljax.sharding: mesh construction and the logical-axis rule table."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from rljax.sharding import (
    LOGICAL_RULES,
    MeshConfig,
    batch_sharding,
    fitted_spec,
    logical_spec,
    make_mesh,
    shard_params,
    state_shardings,
)


def test_make_mesh_resolves_rest_and_is_auto():
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    sub = make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), devices=jax.devices()[:2])
    assert sub.devices.size == 2


@pytest.mark.parametrize("kw, match", [
    (dict(data=0), "MeshConfig.data=0"),
    (dict(data=-1, tensor=-1), "more than one"),
    (dict(tensor=2.0), "must be an int"),
])
def test_mesh_config_rejects_bad_sizes(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MeshConfig(**kw)


def test_mesh_config_device_count_mismatch():
    with pytest.raises(ValueError, match="needs 4 devices but 8"):
        make_mesh(MeshConfig(data=2, fsdp=2, tensor=1))
    with pytest.raises(ValueError, match="not divisible"):
        make_mesh(MeshConfig(data=3, fsdp=-1))


def test_logical_specs(mesh8):
    assert logical_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert logical_spec(("batch", "length")) == P(("data", "fsdp"), None)
    assert dict(LOGICAL_RULES)["vocab"] == "tensor"
    # a dimension not divisible by its mesh axes is replicated
    assert fitted_spec(("embed", "kv_heads"), (32, 1), mesh8) == P("fsdp", None)
    assert batch_sharding(mesh8, 3).spec == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="unknown logical axis name 'embd'"):
        logical_spec(("embd",))
    other = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match="lack 'fsdp'"):
        fitted_spec(("embed",), (8,), other)


def test_state_shardings_and_shard_params(mesh8):
    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 6)), eager_sharding=False, logical_axes=("embed", "mlp"))
            self.plain = nnx.Param(jnp.ones((3,)), eager_sharding=False)

    _, state = nnx.split(Tiny())
    sh = state_shardings(state, mesh8)
    assert sh["w"].get_value().spec == P("fsdp", "tensor")
    assert sh["plain"].get_value().spec == P()
    placed = shard_params(state, mesh8)
    assert placed["w"][...].sharding.spec == P("fsdp", "tensor")


def test_canonical_sharding_and_put_on(mesh8):
    """A state's shardings spelled as a compiled program returns them: trailing None axes
    dropped (the same placement, but unequal, so a program fed one and returning the other
    compiled twice); `put_on` re-spells a tree once and leaves an equal one as it is."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rljax.sharding import canonical_sharding, output_shardings, put_on

    trailing = NamedSharding(mesh8, P("fsdp", None))
    assert canonical_sharding(trailing) == NamedSharding(mesh8, P("fsdp"))
    assert canonical_sharding(NamedSharding(mesh8, P(None,))) == NamedSharding(mesh8, P())
    assert trailing != NamedSharding(mesh8, P("fsdp"))  # why it is needed
    tree = {"w": jax.device_put(jnp.ones((8, 4)), trailing)}
    want = output_shardings(mesh8, tree)
    moved = put_on(tree, want)
    assert moved["w"].sharding == NamedSharding(mesh8, P("fsdp"))
    assert put_on(moved, want) is moved and output_shardings(None, tree) is None


def test_size_one_mesh_axes_are_spelled_as_programs_return_them():
    """On a (1, 8, 1) mesh, P("tensor", "fsdp") and P(None, "fsdp") are one placement; a
    program returns one spelling for every leaf of it (here the policy's for the value
    model's too), so a state placed with the other would compile its step program twice
    (PPO's learning program did, at step 2). Canonical shardings drop size-1 axes."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from rljax.sharding import canonical_sharding, output_shardings, place_outputs, put_on

    mesh = jax.make_mesh((1, 8, 1), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    plain, size_one = NamedSharding(mesh, P(None, "fsdp")), NamedSharding(mesh, P("tensor", "fsdp"))
    assert canonical_sharding(size_one) == canonical_sharding(plain) == plain
    assert canonical_sharding(NamedSharding(mesh, P(("data", "fsdp"), "tensor"))) == plain.update(
        spec=P("fsdp"))
    tree = {"policy": jax.device_put(jnp.ones((4, 8)), plain),
            "value": jax.device_put(jnp.ones((4, 8)), size_one)}
    step = jax.jit(lambda t, sh: place_outputs(mesh, sh, jax.tree.map(lambda x: 2 * x, t))[0],
                   static_argnums=1)
    as_given = (jax.tree.structure(tree), tuple(x.sharding for x in jax.tree.leaves(tree)))
    assert step(tree, as_given)["value"].sharding != size_one  # why it is needed
    want = output_shardings(mesh, tree)
    placed = put_on(tree, want)
    out = step(placed, want)
    assert output_shardings(mesh, out) == want
    assert all(x.sharding == y.sharding for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(out)))
