#include "kernels/cuda/context.h"
#include "kernels/gemm.h"

namespace jnntile {

// cuBLAS is column-major: a row-major (M, N) C is a column-major (N, M) C^T, so
// C^T = op(B)^T op(A)^T is computed with the operands swapped.
template <>
void gemm_f32<Device::Cuda>(bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha,
                            const float* a, const float* b, float beta, float* c) {
  cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  int lda = int(trans_a ? m : k), ldb = int(trans_b ? k : n), ldc = int(n);
  cuda::check(cublasSgemmStridedBatched(cuda::cublas(), op_b, op_a, int(n), int(m), int(k), &alpha, b, ldb, k * n, a,
                                        lda, m * k, &beta, c, ldc, m * n, int(batch)),
              "gemm");
}

}  // namespace jnntile
