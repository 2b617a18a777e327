"""jnntile: train models larger than fast memory. JAX traces, StarPU executes."""

from jnntile import runtime
from jnntile.grad import grad, value_and_grad, zero_grads
from jnntile.tensor import (
    Tensor,
    empty,
    from_array,
    full,
    grad_of,
    random_normal,
    random_uniform,
    release_traced,
    to_array,
    zeros,
)

__all__ = [
    "Tensor", "empty", "from_array", "full", "grad", "grad_of", "value_and_grad", "zero_grads", "random_normal", "random_uniform",
    "release_traced", "runtime", "to_array", "zeros",
]
