"""Tiled GEMM through StarPU vs jnp.dot under jit (XLA CPU), in the same run.

    .venv/bin/python bench/gemm.py [--sizes 1024 2048 4096] [--tiles 512 1024 0] [--repeats 3]
                                   [--dtypes float32 bfloat16]

Prints the best time of each, GFLOP/s and the ratio of throughputs
(jnntile / XLA: 1.0 means as fast as XLA). Tile 0 means one tile per matrix.
bfloat16: operands and result bfloat16, summed in float32 (XLA: jnp.dot with
preferred_element_type float32, rounded); the rows of both dtypes come from the
same run, so their times compare.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jnntile
from jnntile.ops import gemm
from steps import best_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--tiles", type=int, nargs="+", default=[256, 512, 1024, 0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    args = parser.parse_args()
    if args.workers:
        jnntile.runtime.configure(workers=args.workers)
    jnntile.runtime.start()
    print(f"workers={jnntile.runtime.config().workers} scheduler={jnntile.runtime.config().scheduler} "
          f"OpenBLAS kernels={jnntile.runtime.blas_core()} jax devices={jax.devices()}")
    print(f"{'n':>6} {'dtype':>9} {'tile':>6} {'jnntile ms':>11} {'GFLOP/s':>8} {'XLA ms':>8} {'GFLOP/s':>8} "
          f"{'ratio':>6}")
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    for n in args.sizes:
        rng = np.random.default_rng(0)
        a_np = rng.standard_normal((n, n), dtype=np.float32)
        b_np = rng.standard_normal((n, n), dtype=np.float32)
        flops = 2.0 * n**3
        for dtype in args.dtypes:
            a_x, b_x = jnp.asarray(a_np, dtype), jnp.asarray(b_np, dtype)
            xla_s = best_seconds(lambda: dot(a_x, b_x).block_until_ready(), args.repeats)
            for tile in sorted({t or n for t in args.tiles if (t or n) <= n}):
                a = jnntile.from_array(a_np, tile, dtype=dtype)
                b = jnntile.from_array(b_np, tile, dtype=dtype)

                def run():
                    c = gemm.matmul(a, b)
                    jnntile.runtime.wait_all()
                    return c

                tiled_s = best_seconds(run, args.repeats)
                print(f"{n:6d} {dtype:>9} {tile:6d} {tiled_s * 1e3:11.1f} {flops / tiled_s / 1e9:8.1f} "
                      f"{xla_s * 1e3:8.1f} {flops / xla_s / 1e9:8.1f} {xla_s / tiled_s:6.2f}")
                a.free()
                b.free()


if __name__ == "__main__":
    main()
