// Matrix products on tiles: BLAS on the CPU, cuBLAS on the GPU, from the same
// tile descriptor.
#pragma once
#include "kernels/device.h"

namespace jnntile {

// C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] for b in [0, batch), row-major,
// op(A) is (M, K), op(B) is (K, N); consecutive batch matrices are contiguous.
// beta == 0 ignores what C held (its tile may never have been written).
// A and B are both float32 or both bfloat16, C either (`types`); products accumulate in float32.
struct GemmTypes {
  FloatType a, b, c;
  bool all_f32() const { return a == FloatType::F32 && b == FloatType::F32 && c == FloatType::F32; }
};
// Floats of working memory a CPU task needs: the float32 sum of a bfloat16 C (the GPU needs none).
int64_t gemm_scratch_floats(GemmTypes types, int64_t batch, int64_t m, int64_t n, int64_t k);
template <Device D>
void gemm(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, const void* b, float beta, void* c, float* scratch);

// One row-major float32 product on the CPU through the BLAS the tile products use (oneMKL where loaded,
// else OpenBLAS), with explicit leading dimensions: C = alpha op(A) op(B) + beta C.
void cpu_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C float32 = alpha op(A) op(B) + beta C on bfloat16 operands, summed in float32, with explicit leading
// dimensions: oneMKL's product where loaded (AMX, AVX512-BF16), else jnntile's own, which converts the
// operands while it packs them (kernels/cpu/gemm.cc).
void cpu_bf16_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                   int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Makes the CPU BLAS single-threaded: StarPU workers provide the parallelism.
void gemm_single_threaded();
// The name of the kernel family the CPU BLAS picked, e.g. "SkylakeX".
const char* blas_core();

}  // namespace jnntile
