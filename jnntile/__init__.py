"""jnntile: train models larger than fast memory. JAX traces, StarPU executes.

The package's layers are its folders, each above the ones before it:

    core/       the StarPU runtime, tiled tensors and their per-step ledger, gradients, ranks
    ops/        tiled ops (one module per op family), each a custom_vjp over FFI calls that submit tasks
    nn/         Flax NNX layers on those ops
    models/     model families (gpt2/, llama/), Hugging Face files, incremental decoding
    io/         safetensors files streamed to and from tiles, JSON files read with clear errors
    training/   the training step, Optax transformations, LoRA adapters, checkpoints
    planning/   the memory planner: what a step needs, and the tiles and recomputation that fit
    data/       token and fine-tuning datasets, and the `python -m jnntile.data` command

and the commands, `python -m jnntile.train`, `generate`, `memory` (with `flags`, the flags they share).
The modules users import keep their short names: `jnntile.runtime`, `jnntile.optim`, `jnntile.step`, ...
(PUBLIC_MODULES below).
"""

import sys

# runtime first: it imports JAX and sets up the BLAS before the native module loads (with the CUDA build,
# loading the native module before JAX crashed JAX's import on an H200, in ml_dtypes).
from jnntile.core import runtime  # noqa: I001
from jnntile.core import distributed  # its check of the ranks at start
from jnntile.core import ledger, tensor
from jnntile.core.grad import grad, grad_of, remat, value_and_grad, zero_grads
from jnntile.core.tensor import Tensor, release_traced
from jnntile.io import jsonfile, tensorfile
from jnntile.models import decoding
from jnntile.ops.values import convert, empty, from_array, full, random_normal, random_uniform, to_array, zeros
from jnntile.training import checkpoint, lora, optim, step

# The short names users import (`import jnntile.optim`, `from jnntile.runtime import configure`), each the module
# of its layer. `jnntile.grad` stays the function; its module is jnntile.core.grad.
PUBLIC_MODULES = {"runtime": runtime, "distributed": distributed, "ledger": ledger, "tensor": tensor,
                  "jsonfile": jsonfile, "tensorfile": tensorfile, "decoding": decoding, "checkpoint": checkpoint,
                  "lora": lora, "optim": optim, "step": step}
for _name, _module in PUBLIC_MODULES.items():
    sys.modules.setdefault(f"{__name__}.{_name}", _module)

__all__ = [
    "Tensor", "convert", "empty", "from_array", "full", "grad", "grad_of", "random_normal", "random_uniform",
    "release_traced", "remat", "runtime", "to_array", "value_and_grad", "zero_grads", "zeros",
]
