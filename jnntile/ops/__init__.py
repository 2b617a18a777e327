"""Tiled ops: each is a `jax.custom_vjp` over FFI calls that only submit StarPU tasks."""
