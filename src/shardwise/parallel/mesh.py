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

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from shardwise.env import Env
from shardwise.errors import ConflictError, EnvError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshLayout", "SPLITS", "layout", "layout_of", "data_share", "build", "data_mesh",
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
        return math.prod(self.size(name) for name, _ in SPLITS)

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


def data_share(env: Env, mesh: MeshLayout | None, replica: tuple[int, int] | None = None
               ) -> tuple[int, int, int]:
    """``(shares, share, copies)``: how many different shares of the data the ranks read,
    which one this rank reads, and how many ranks read each (one ``pp x cp x tp`` block);
    without a mesh every rank reads its own. ``replica``: ``(group, groups)`` of
    ``fault_tolerant()``'s replica groups, each its own job of ``env``'s ranks: group g's
    shares follow group g - 1's (torchft's ``DistributedSampler`` split). The one place
    this is worked out: the data split, the Trainer's Accelerate-style split and its epoch
    remainder ask it."""
    if mesh is None:
        shares, share, copies = env.world_size, env.rank, 1
    else:
        shares, share, copies = mesh.data_ranks(env.world_size), mesh.data_rank(env.rank), \
            mesh.copies
    if replica is not None:
        group, groups = replica
        shares, share = shares * groups, group * shares + share
    return shares, share, copies


#: the dimensions that split the model, outermost first, each with the transform that asks
#: for it: the ranks of one block of them read the same batch, the ranks left over form the
#: data dimensions. A new kind of model split is one row here and a transform declaring
#: it in ``mesh_dims()``; its size, its place, the block, the checks and the messages follow.
SPLITS: tuple[tuple[str, str], ...] = (("pp", "pipeline_parallel"), ("cp", "context_parallel"),
                                       ("tp", "tensor_parallel"))


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
        asked: how the ``tp`` size was asked for, for messages (default ``size=<tp>``).
        with_tp: a ``tp`` dimension (of size ``tp``); without one, the data dimensions only.
        cp: ranks per context-parallel group: a ``cp`` dimension (None: none).
        pp: ranks per pipeline-parallel group: a ``pp`` dimension (None: none).

    Raises:
        EnvError: the world (or a node) does not divide into the groups asked for.

    Example:
        >>> layout(sw.Env(world_size=8, local_world_size=8), tp=2).describe()
        'dp_shard=4 x tp=2'
    """
    sizes = {"pp": pp, "cp": cp, "tp": tp if with_tp else None}
    return _sized(env, {k: v for k, v in sizes.items() if v is not None},
                  replicate_across_nodes, {"tp": asked} if asked else {})


def _sized(env: Env, sizes: dict[str, int], replicate_across_nodes: bool,
           asked: dict[str, str]) -> MeshLayout:
    """The layout of the splitting dimensions ``sizes`` (by name, from :data:`SPLITS`), the
    data dimensions around them; ``asked``: how a size was asked for, for messages."""
    world = env.world_size
    given = [(name, factory, sizes[name]) for name, factory in SPLITS if name in sizes]
    block = math.prod(size for _, _, size in given)
    if any(size < 1 for _, _, size in given) or world % block:
        parts = " x ".join(f"{factory}({asked.get(name) or f'size={size}'})"
                           for name, factory, size in given)
        sizes_ = "a size that divides" if len(given) == 1 else "sizes whose product divides"
        raise EnvError(f"{parts} must divide the world size {world} (the ranks left over form "
                       f"the data-parallel dimensions); launch a multiple of {block} processes, "
                       f"or pass {sizes_} {world}")
    dims: list[tuple[str, int]] = []
    if replicate_across_nodes:
        per_node = env.local_world_size
        if env.num_nodes * per_node != world or per_node % block or \
                env.rank != env.node_rank * per_node + env.local_rank:
            shown = ", ".join(f"{name}={size}" for name, _, size in given)
            raise EnvError(
                f"a mesh replicated across nodes (shard(replicate_across_nodes=True)) needs the "
                f"same number of ranks on every node, numbered node by node, a multiple of the "
                f"model-parallel block (got world_size={world}, num_nodes={env.num_nodes}, "
                f"local_world_size={per_node}, rank={env.rank}, node_rank={env.node_rank}, "
                f"local_rank={env.local_rank}{', ' + shown if shown else ''}); launch an "
                "equal number of processes per node, or pass shard() a mesh of your own")
        dims.append(("dp_replicate", env.num_nodes))
        dims.append(("dp_shard", per_node // block))
    else:
        dims.append(("dp_shard", world // block))
    return MeshLayout((*dims, *((name, size) for name, _, size in given)))


def layout_of(env: Env, transforms: Iterable[Any]) -> MeshLayout | None:
    """The one mesh ``transforms`` run on under ``env``: the dimensions they declare
    (``mesh_dims()``), sized here; None in one process, or when none declares one. A
    splitting dimension left at ``size=None`` takes the ranks of a node the dimensions
    inside it leave (``tp``, innermost: the whole node)."""
    declared: dict[str, int | None] = {}
    for transform in transforms:
        for name, size in transform.mesh_dims().items():
            declared[name] = size if size is not None else declared.get(name)
    if not declared or not env.is_distributed:
        return None
    sizes: dict[str, int] = {}
    asked: dict[str, str] = {}
    inner = 1
    for name, _ in reversed(SPLITS):  # innermost first: a default fills what is left
        if name not in declared:
            continue
        size = declared[name]
        if size is None:
            size = max(1, env.local_world_size // inner)
            asked[name] = f"size=None: the {size} ranks of a node" + (
                " left by the groups inside it" if inner > 1 else "")
        sizes[name] = size
        inner *= size
    return _sized(env, sizes, "dp_replicate" in declared, asked)


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
