#include "kernels/cuda/context.h"
#include "kernels/gemm.h"

namespace jnntile {
namespace {

cudaDataType_t cuda_type(FloatType type) { return type == FloatType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

}  // namespace

// cuBLAS is column-major: a row-major (M, N) C is a column-major (N, M) C^T, so
// C^T = op(B)^T op(A)^T is computed with the operands swapped. float32 operands keep
// cublasSgemmStridedBatched (its math mode, TF32 or not, is the handle's: kernels/cuda/context.cc);
// bfloat16 ones go through cublasGemmStridedBatchedEx with float32 accumulation.
template <>
void gemm<Device::Cuda>(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                        float alpha, const void* a, const void* b, float beta, void* c, float*) {
  cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  int lda = int(trans_a ? m : k), ldb = int(trans_b ? k : n), ldc = int(n);
  if (types.all_f32()) {
    cuda::check(cublasSgemmStridedBatched(cuda::cublas(), op_b, op_a, int(n), int(m), int(k), &alpha,
                                          static_cast<const float*>(b), ldb, k * n, static_cast<const float*>(a),
                                          lda, m * k, &beta, static_cast<float*>(c), ldc, m * n, int(batch)),
                "gemm");
    return;
  }
  cuda::check(cublasGemmStridedBatchedEx(cuda::cublas(), op_b, op_a, int(n), int(m), int(k), &alpha, b,
                                         cuda_type(types.b), ldb, k * n, a, cuda_type(types.a), lda, m * k, &beta, c,
                                         cuda_type(types.c), ldc, m * n, int(batch), CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT),
              "gemm (bfloat16)");
}

}  // namespace jnntile
