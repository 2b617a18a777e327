#include "kernels/gemm.h"

#include <cblas.h>

#include "kernels/data.h"

namespace jnntile {

int64_t gemm_scratch_floats(GemmTypes types, int64_t batch, int64_t m, int64_t n, int64_t k) {
  return batch * ((types.a == FloatType::BF16 ? m * k : 0) + (types.b == FloatType::BF16 ? k * n : 0) +
                  (types.c == FloatType::BF16 ? m * n : 0));
}

// bfloat16 operands are widened into float32 scratch for sgemm (this CPU's BLAS has no faster bfloat16
// product: OpenBLAS's sbgemm needs AVX512-BF16), and a bfloat16 C is rounded back once at the end.
template <>
void gemm<Device::Cpu>(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       float alpha, const void* a, const void* b, float beta, void* c, float* scratch) {
  auto as_f32 = [&](FloatType type, const void* tile, int64_t count) -> float* {
    if (type == FloatType::F32) return static_cast<float*>(const_cast<void*>(tile));
    float* widened = scratch;
    scratch += count;
    convert<Device::Cpu>(count, type, tile, FloatType::F32, widened);
    return widened;
  };
  const float* a32 = as_f32(types.a, a, batch * m * k);
  const float* b32 = as_f32(types.b, b, batch * k * n);
  float* c32 = types.c == FloatType::F32 ? static_cast<float*>(c) : scratch;
  if (types.c == FloatType::BF16 && beta != 0.0f) convert<Device::Cpu>(batch * m * n, types.c, c, FloatType::F32, c32);
  for (int64_t i = 0; i < batch; ++i)
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                m, n, k, alpha, a32 + i * m * k, trans_a ? m : k, b32 + i * k * n, trans_b ? k : n, beta,
                c32 + i * m * n, n);
  if (types.c == FloatType::BF16) convert<Device::Cpu>(batch * m * n, FloatType::F32, c32, types.c, c);
}

void gemm_single_threaded() { openblas_set_num_threads(1); }

const char* blas_core() { return openblas_get_corename(); }

}  // namespace jnntile
