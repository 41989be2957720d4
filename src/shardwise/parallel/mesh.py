# The device mesh of a pipeline: its named dimensions, their sizes, and each rank's place in them.
"""One DeviceMesh per pipeline, with named dimensions (``dp_replicate``, ``dp_shard``, ``pp``,
``cp``, ``tp``).

The layout is decided here and nowhere else: each transform declares the dimensions it runs
on (:meth:`~shardwise.transforms.base.Transform.mesh_dims`: ``shard()`` the data dimensions,
``tensor_parallel`` ``tp``), :func:`layout_of` sizes them (the only place a size is worked
out), :func:`shardwise.transforms.base.plan_for` works the layout out once, where the plan
is built, and carries it in the plan (``Plan.mesh``); the pipeline builds the one mesh from
it, and the transforms, the data split, the step, the memory estimate and ``explain()`` read
their sizes from that value, by name. ``tp`` is the innermost dimension, so the ranks
of one tensor-parallel group are consecutive, on one node when a node holds a multiple of the
group (their collectives run every layer, the data dimensions' once per step); ``cp``
(context parallel: each rank a slice of every sequence, an exchange around every attention)
is next, then ``pp`` (pipeline parallel: each rank the layers of its stages, activations
sent to the next stage's rank). The ranks of one ``pp x cp x tp`` block read the same batch
(the first stage its inputs, the last its labels).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from shardwise.env import Env
from shardwise.errors import ConflictError, EnvError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshLayout", "layout", "layout_of", "tp_size", "build", "data_mesh",
           "with_dimension", "stage_peers"]


@attrs.frozen
class MeshLayout:
    """The named dimensions of a mesh over all ranks, outermost first.

    Attributes:
        dims: ``(name, size)`` pairs whose sizes multiply to the world size.
    """

    dims: tuple[tuple[str, int], ...]

    def size(self, name: str) -> int:
        """The size of dimension ``name`` (1 when the mesh has no such dimension)."""
        return dict(self.dims).get(name, 1)

    @property
    def tp(self) -> int:
        """Ranks each tensor-parallel group spans."""
        return self.size("tp")

    @property
    def cp(self) -> int:
        """Ranks each context-parallel group spans (each holds a slice of every sequence)."""
        return self.size("cp")

    @property
    def pp(self) -> int:
        """Ranks each pipeline-parallel group spans (each holds the layers of its stages)."""
        return self.size("pp")

    @property
    def copies(self) -> int:
        """Ranks that read each batch: one pipeline-, context- and tensor-parallel block
        (``pp x cp x tp``)."""
        return self.pp * self.cp * self.tp

    @property
    def data_names(self) -> tuple[str, ...]:
        """The data-parallel dimensions, outermost first."""
        return tuple(name for name, _ in self.dims if name.startswith("dp_"))

    @property
    def holders(self) -> int:
        """Ranks that hold the same part of the model and reduce its gradients together: the
        data dimensions with ``cp`` (its ranks hold one replica, like data ranks)."""
        return self.shard_ranks * self.size("dp_replicate")

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP2 splits each parameter over: the innermost data dimension, ``cp``
        folded in (:func:`data_mesh`)."""
        return self.size("dp_shard") * self.cp

    @classmethod
    def of_mesh(cls, mesh: DeviceMesh) -> MeshLayout:
        """The layout of a data mesh of the user's own (``shard(mesh=...)``): FSDP2 shards
        over its last dimension and replicates over the first of two."""
        shape = tuple(int(n) for n in mesh.shape)
        return cls(tuple(zip(("dp_replicate", "dp_shard")[-len(shape):], shape, strict=True)))

    def data_ranks(self, world_size: int) -> int:
        """Ranks that read different batches: the world over the ``pp x cp x tp`` blocks."""
        return world_size // self.copies

    def data_rank(self, rank: int) -> int:
        """Which batch share ``rank`` reads: the ranks of one ``pp x cp x tp`` block
        (consecutive, innermost) read the same one."""
        return rank // self.copies

    def describe(self) -> str:
        """``dp_shard=2 x tp=2``."""
        return " x ".join(f"{name}={size}" for name, size in self.dims)


def tp_size(env: Env, asked: int | None) -> int:
    """Ranks per tensor-parallel group: the size asked for, or (None) the ranks of a node."""
    return asked if asked is not None else env.local_world_size


def layout(env: Env, *, tp: int = 1, replicate_across_nodes: bool = False,
           asked: str | None = None, with_tp: bool = True, cp: int | None = None,
           pp: int | None = None) -> MeshLayout:
    """The mesh for ``env`` with tensor-parallel groups of ``tp`` ranks (and context-parallel
    groups of ``cp``, pipeline-parallel groups of ``pp``), the rest data parallel
    (replicated across nodes and sharded within one, when asked).

    Args:
        env: the ranks.
        tp: ranks per tensor-parallel group.
        replicate_across_nodes: a ``dp_replicate`` dimension of one replica per node.
        asked: how the size was asked for, for messages (default ``size=<tp>``).
        with_tp: a ``tp`` dimension (of size ``tp``); without one, the data dimensions only.
        cp: ranks per context-parallel group: a ``cp`` dimension (None: none).
        pp: ranks per pipeline-parallel group: a ``pp`` dimension (None: none).

    Raises:
        EnvError: the world (or a node) does not divide into the groups asked for.

    Example:
        >>> layout(sw.Env(world_size=8, local_world_size=8), tp=2).describe()
        'dp_shard=4 x tp=2'
    """
    world = env.world_size
    if tp < 1 or world % tp:
        raise EnvError(f"tensor_parallel({asked or f'size={tp}'}) must divide the world size {world} (the "
                       "ranks left over form the data-parallel dimensions); launch a multiple "
                       f"of {tp} processes, or pass a size that divides {world}")
    block = tp * (cp or 1) * (pp or 1)
    if (cp is not None or pp is not None) and ((cp or 1) < 1 or (pp or 1) < 1 or world % block):
        parts = [f"{name}(size={size})" for name, size in (
            ("pipeline_parallel", pp), ("context_parallel", cp)) if size is not None]
        raise EnvError(f"{' x '.join([*parts, f'tensor_parallel(size={tp})'])} must divide "
                       f"the world size {world} (the ranks left over form the data-parallel "
                       f"dimensions); launch a multiple of {block} processes, or pass sizes "
                       f"whose product divides {world}")
    dims: list[tuple[str, int]] = []
    if replicate_across_nodes:
        per_node = env.local_world_size
        if env.num_nodes * per_node != world or per_node % block or \
                env.rank != env.node_rank * per_node + env.local_rank:
            raise EnvError(
                f"a mesh replicated across nodes (shard(replicate_across_nodes=True)) needs the "
                f"same number of ranks on every node, numbered node by node, a multiple of the "
                f"tensor-parallel size (got world_size={world}, num_nodes={env.num_nodes}, "
                f"local_world_size={per_node}, rank={env.rank}, node_rank={env.node_rank}, "
                f"local_rank={env.local_rank}, tp={tp}, cp={cp or 1}, pp={pp or 1}); launch an "
                "equal number of processes per node, or pass shard() a mesh of your own")
        dims.append(("dp_replicate", env.num_nodes))
        dims.append(("dp_shard", per_node // block))
    else:
        dims.append(("dp_shard", world // block))
    if pp is not None:
        dims.append(("pp", pp))
    if cp is not None:
        dims.append(("cp", cp))
    if with_tp:
        dims.append(("tp", tp))
    return MeshLayout(tuple(dims))


def layout_of(env: Env, transforms: Iterable[Any]) -> MeshLayout | None:
    """The one mesh ``transforms`` run on under ``env``: the dimensions they declare
    (``mesh_dims()``), sized here; None in one process, or when none declares one."""
    asked: dict[str, int | None] = {}
    for transform in transforms:
        for name, size in transform.mesh_dims().items():
            asked[name] = size if size is not None else asked.get(name)
    if not asked or not env.is_distributed:
        return None
    with_tp = "tp" in asked
    tp = tp_size(env, asked.get("tp")) if with_tp else 1
    how = None if asked.get("tp") is not None or not with_tp else \
        f"size=None: the {env.local_world_size} ranks of a node"
    cp = None
    if "cp" in asked:  # None: the ranks of a node the tensor-parallel groups leave
        cp = asked["cp"] if asked["cp"] is not None else max(1, env.local_world_size // tp)
    pp = None
    if "pp" in asked:  # None: the ranks of a node the other groups leave
        pp = asked["pp"] if asked["pp"] is not None else max(1, env.local_world_size // (
            tp * (cp or 1)))
    return layout(env, tp=tp, replicate_across_nodes="dp_replicate" in asked, asked=how,
                  with_tp=with_tp, cp=cp, pp=pp)


def data_mesh(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The part of ``mesh`` that FSDP2 shards over: its data dimensions ``dims``, with ``cp``
    folded into the innermost one (the ranks of a context-parallel group hold one replica
    of the parameters, like data ranks: their gradients are reduced together)."""
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        return mesh if names == dims else mesh[dims]
    inner = f"{dims[-1]}_cp"
    flat = mesh[(dims[-1], "cp")]._flatten(inner)
    return flat if len(dims) == 1 else mesh[tuple([*dims[:-1], inner])]


def build(env: Env, mesh: MeshLayout) -> DeviceMesh:
    """The torch ``DeviceMesh`` of ``mesh`` over all ranks (one process group per dimension)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, tuple(size for _, size in mesh.dims),
                            mesh_dim_names=tuple(name for name, _ in mesh.dims))


def with_dimension(mesh: DeviceMesh | None, env: Env, layout: MeshLayout | None, name: str,
                   size: int, who: str) -> DeviceMesh:
    """The bundle's ``mesh`` (or, applied by hand, one built for ``layout``), checked to have
    dimension ``name`` of ``size`` ranks.

    Raises:
        ConflictError: it has not, naming ``who``.
    """
    found = mesh if mesh is not None else build(env, layout) if layout is not None else None
    if found is None or name not in (found.mesh_dim_names or ()) or int(found[name].size()) != size:
        raise ConflictError(f"{who}: the bundle's mesh {found} has no '{name}' dimension of size "
                            f"{size}; let sw.pipeline(...) build it")
    return found


def stage_peers(mesh: DeviceMesh) -> Any:
    """The process group of the ranks that hold the same pipeline stages as this one (every
    dimension of ``mesh`` but ``pp``), or the whole world's when ``mesh`` has no ``pp``.
    Collective: every rank calls it (one group is made per stage position)."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        return dist.group.WORLD
    axis = names.index("pp")
    ranks = mesh.mesh.movedim(axis, 0).reshape(mesh.mesh.shape[axis], -1)
    groups = [dist.new_group(row.tolist()) for row in ranks]
    return groups[int(mesh["pp"].get_local_rank())]
