"""The lowest layer: the StarPU runtime (runtime), tiled tensors (tensor) and their per-step state (ledger),
gradients through JAX's autodiff (grad), and MPI ranks (distributed)."""
