"""jnntile: train models larger than fast memory. JAX traces, StarPU executes."""

# runtime first: it imports JAX and sets up the BLAS before the native module loads (with the CUDA build,
# loading the native module before JAX crashed JAX's import on an H200, in ml_dtypes).
from jnntile import runtime  # noqa: I001
from jnntile import distributed  # its check of the ranks at start
from jnntile.grad import grad, grad_of, remat, value_and_grad, zero_grads
from jnntile.ops.values import convert, empty, from_array, full, random_normal, random_uniform, to_array, zeros
from jnntile.tensor import Tensor, release_traced

__all__ = [
    "Tensor", "convert", "empty", "from_array", "full", "grad", "grad_of", "random_normal", "random_uniform", "release_traced",
    "remat", "runtime", "to_array", "value_and_grad", "zero_grads", "zeros",
]
