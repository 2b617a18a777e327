#include "kernels/gemm.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/data.h"

namespace jnntile {
namespace {

// oneMKL, when the environment names its runtime library (JNNTILE_MKL, set by jnntile/_blas.py where the
// `mkl` package is installed): its sgemm, and its bfloat16 product, which runs on AMX / AVX512-BF16 and sums
// in float32 (measured on one core of a Sapphire Rapids VM, 512 x 768 x 768: OpenBLAS 0.3.21 sgemm 170
// GFLOP/s, MKL sgemm 193, MKL bfloat16 757). Loaded with dlopen, so the build needs no MKL and a machine
// without it keeps OpenBLAS. Its CBLAS enums are the standard values OpenBLAS's cblas.h uses.
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
using Bf16GemmFn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                            float*, int);

struct Mkl {
  SgemmFn sgemm = nullptr;
  Bf16GemmFn bf16_gemm = nullptr;
};

Mkl load_mkl() {
  const char* path = std::getenv("JNNTILE_MKL");
  if (path == nullptr || *path == '\0') return {};
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "jnntile: JNNTILE_MKL=%s does not load (%s); matrix products use OpenBLAS\n", path,
                 dlerror());
    return {};
  }
  Mkl mkl{reinterpret_cast<SgemmFn>(dlsym(lib, "cblas_sgemm")),
          reinterpret_cast<Bf16GemmFn>(dlsym(lib, "cblas_gemm_bf16bf16f32"))};
  if (mkl.sgemm == nullptr || mkl.bf16_gemm == nullptr) {
    std::fprintf(stderr, "jnntile: %s lacks cblas_sgemm or cblas_gemm_bf16bf16f32; matrix products use OpenBLAS\n",
                 path);
    return {};
  }
  return mkl;
}

const Mkl& mkl() {
  static const Mkl loaded = load_mkl();
  return loaded;
}

void openblas_sgemm(int order, int op_a, int op_b, int m, int n, int k, float alpha, const float* a, int lda,
                    const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CBLAS_ORDER(order), CBLAS_TRANSPOSE(op_a), CBLAS_TRANSPOSE(op_b), m, n, k, alpha, a, lda, b, ldb, beta,
              c, ldc);
}

bool mkl_bf16(GemmTypes types) {
  return types.a == FloatType::BF16 && types.b == FloatType::BF16 && cpu_has_bf16_gemm();
}

}  // namespace

int64_t gemm_scratch_floats(GemmTypes types, int64_t batch, int64_t m, int64_t n, int64_t k) {
  int64_t c = types.c == FloatType::BF16 ? m * n : 0;  // a bfloat16 C is summed in float32, rounded once
  if (mkl_bf16(types)) return std::max<int64_t>(1, batch * c);
  return batch * ((types.a == FloatType::BF16 ? m * k : 0) + (types.b == FloatType::BF16 ? k * n : 0) + c);
}

// Without MKL, bfloat16 operands are widened into float32 scratch for sgemm (Debian's OpenBLAS 0.3.21 has no
// sbgemm); a bfloat16 C is summed in float32 scratch and rounded back once at the end.
template <>
void gemm<Device::Cpu>(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       float alpha, const void* a, const void* b, float beta, void* c, float* scratch) {
  float* c32 = types.c == FloatType::F32 ? static_cast<float*>(c) : nullptr;
  auto as_f32 = [&](FloatType type, const void* tile, int64_t count) -> float* {
    if (type == FloatType::F32) return static_cast<float*>(const_cast<void*>(tile));
    float* widened = scratch;
    scratch += count;
    convert<Device::Cpu>(count, type, tile, FloatType::F32, widened);
    return widened;
  };
  bool bf16 = mkl_bf16(types);  // MKL multiplies bfloat16 operands as they are
  const void* a_in = bf16 ? a : as_f32(types.a, a, batch * m * k);
  const void* b_in = bf16 ? b : as_f32(types.b, b, batch * k * n);
  if (c32 == nullptr) c32 = scratch;
  if (types.c == FloatType::BF16 && beta != 0.0f) convert<Device::Cpu>(batch * m * n, types.c, c, FloatType::F32, c32);
  int lda = trans_a ? m : k, ldb = trans_b ? k : n;
  for (int64_t i = 0; i < batch; ++i) {
    if (bf16)
      cpu_bf16_gemm(trans_a, trans_b, m, n, k, alpha, static_cast<const bfloat16*>(a_in) + i * m * k, lda,
                    static_cast<const bfloat16*>(b_in) + i * k * n, ldb, beta, c32 + i * m * n, n);
    else
      cpu_sgemm(trans_a, trans_b, m, n, k, alpha, static_cast<const float*>(a_in) + i * m * k, lda,
                static_cast<const float*>(b_in) + i * k * n, ldb, beta, c32 + i * m * n, n);
  }
  if (types.c == FloatType::BF16) convert<Device::Cpu>(batch * m * n, FloatType::F32, c32, types.c, c);
}

void cpu_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  SgemmFn sgemm = mkl().sgemm != nullptr ? mkl().sgemm : openblas_sgemm;
  sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(m), int(n),
        int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

bool cpu_has_bf16_gemm() { return mkl().bf16_gemm != nullptr; }

void cpu_bf16_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                   int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mkl().bf16_gemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(m),
                  int(n), int(k), alpha, reinterpret_cast<const uint16_t*>(a), int(lda),
                  reinterpret_cast<const uint16_t*>(b), int(ldb), beta, c, int(ldc));
}

void gemm_single_threaded() {
  openblas_set_num_threads(1);
  mkl();  // loaded at start, not in the first task
}

const char* blas_core() { return mkl().sgemm != nullptr ? "oneMKL" : openblas_get_corename(); }

}  // namespace jnntile
