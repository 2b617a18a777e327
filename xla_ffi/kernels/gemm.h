// Matrix products on tiles: BLAS on the CPU, cuBLAS on the GPU, from the same
// tile descriptor.
#pragma once
#include "kernels/device.h"

namespace jnntile {

// C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] for b in [0, batch), row-major,
// op(A) is (M, K), op(B) is (K, N); consecutive batch matrices are contiguous.
// beta == 0 ignores what C held (its tile may never have been written).
template <Device D>
void gemm_f32(bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              const float* b, float beta, float* c);

// Makes the CPU BLAS single-threaded: StarPU workers provide the parallelism.
void gemm_single_threaded();
// The name of the kernel family the CPU BLAS picked, e.g. "SkylakeX".
const char* blas_core();

}  // namespace jnntile
