# Checkpoints: DCP's sharded files under an atomic, verified layout; saves in the background; exports.
"""Everything that writes or reads training state on disk.

- ``save_load``: ``sw.save`` / ``sw.load`` (DCP, train state, data position).
- ``restore``: the steps of ``sw.load`` (find an intact checkpoint, check it fits, read
  it all or nothing, position the loader).
- ``background``: ``sw.save(..., blocking=False)``, published when every rank is done.
- ``layout``: ``step_N`` directories, which checkpoints are published, ``latest``.
- ``lock``: one writer per root (an OS file lock held by rank 0 for the whole save).
- ``transaction``: recovering what a crash left, publishing in renames, ``keep_last``.
- ``integrity``: the sealed checksums every load verifies first.
- ``safe_reader``: DCP metadata read through an allow-list, never an arbitrary unpickle.
- ``rng``: each rank's random generators, as JSON.
- ``full_weights``: ``sw.export``, the whole model as safetensors.
"""

from shardwise.checkpoint.save_load import latest_checkpoint, load, save

__all__ = ["save", "load", "latest_checkpoint"]
