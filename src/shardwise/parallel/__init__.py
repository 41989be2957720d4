"""The mesh and the internals of tensor, context and pipeline parallelism."""
