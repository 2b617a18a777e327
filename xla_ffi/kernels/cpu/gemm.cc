#include "kernels/gemm.h"

#include <cblas.h>

namespace jnntile {

template <>
void gemm_f32<Device::Cpu>(bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k, float alpha,
                           const float* a, const float* b, float beta, float* c) {
  for (int64_t i = 0; i < batch; ++i)
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                m, n, k, alpha, a + i * m * k, trans_a ? m : k, b + i * k * n, trans_b ? k : n, beta,
                c + i * m * n, n);
}

void gemm_single_threaded() { openblas_set_num_threads(1); }

const char* blas_core() { return openblas_get_corename(); }

}  // namespace jnntile
