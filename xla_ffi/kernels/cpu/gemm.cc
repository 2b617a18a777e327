#include "kernels/gemm.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

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
  // A bfloat16 C is summed in float32, rounded once; bfloat16 operands are widened into each worker's own
  // panels (below), not into the task's scratch.
  return types.c == FloatType::BF16 ? batch * m * n : 0;
}

namespace {

// Without MKL's bfloat16 product (OpenBLAS 0.3.21 has no sbgemm), bfloat16 operands are widened to float32
// for sgemm, kPanelK columns of K at a time, into buffers of the worker's own that stay allocated (at most
// (m + n) x kPanelK floats each): a widened panel is still in cache when sgemm packs it, and no page is
// faulted in per task. Widened whole into the task's StarPU scratch instead, which every task allocated and
// freed, a bfloat16 GPT-2 124M step spent 4.5% of its time widening (3.2%) and clearing fresh pages (1.3%),
// on an AMD EPYC with OpenBLAS (perf). 256 is also OpenBLAS's own blocking of K on AVX2 cores.
constexpr int64_t kPanelK = 256;

// Columns [k0, k0 + kb) of the K axis of one operand as float32, with its leading dimension. The operand
// is stored row-major as other x k (K is its column axis: A, or B transposed) or k x other (A transposed,
// or B); float32 is read in place, bfloat16 widened into `panel`.
struct Panel {
  const float* data;
  int64_t ld;
};

Panel k_panel(FloatType type, const void* x, bool k_is_column, int64_t other, int64_t k, int64_t k0, int64_t kb,
              std::vector<float>& panel) {
  if (type == FloatType::F32) {
    const float* f = static_cast<const float*>(x);
    return k_is_column ? Panel{f + k0, k} : Panel{f + k0 * other, other};
  }
  if (panel.size() < size_t(other * kb)) panel.resize(size_t(other * kb));
  const bfloat16* b = static_cast<const bfloat16*>(x);
  if (!k_is_column) {
    convert<Device::Cpu>(kb * other, type, b + k0 * other, FloatType::F32, panel.data());
    return {panel.data(), other};
  }
  for (int64_t row = 0; row < other; ++row)
    convert<Device::Cpu>(kb, type, b + row * k + k0, FloatType::F32, panel.data() + row * kb);
  return {panel.data(), kb};
}

size_t element_size(FloatType type) { return type == FloatType::F32 ? sizeof(float) : sizeof(bfloat16); }

}  // namespace

// A bfloat16 C is summed in float32 scratch and rounded back once at the end.
template <>
void gemm<Device::Cpu>(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       float alpha, const void* a, const void* b, float beta, void* c, float* scratch) {
  float* c32 = types.c == FloatType::F32 ? static_cast<float*>(c) : scratch;
  if (types.c == FloatType::BF16 && beta != 0.0f) convert<Device::Cpu>(batch * m * n, types.c, c, FloatType::F32, c32);
  const bool bf16 = mkl_bf16(types);  // MKL multiplies bfloat16 operands as they are
  const bool widened = !bf16 && (types.a == FloatType::BF16 || types.b == FloatType::BF16);
  const int64_t panel_k = widened ? kPanelK : std::max<int64_t>(k, 1);
  thread_local std::vector<float> a_panel, b_panel;
  for (int64_t i = 0; i < batch; ++i) {
    const char* a_i = static_cast<const char*>(a) + i * m * k * element_size(types.a);
    const char* b_i = static_cast<const char*>(b) + i * k * n * element_size(types.b);
    float* c_i = c32 + i * m * n;
    if (bf16) {
      cpu_bf16_gemm(trans_a, trans_b, m, n, k, alpha, reinterpret_cast<const bfloat16*>(a_i), trans_a ? m : k,
                    reinterpret_cast<const bfloat16*>(b_i), trans_b ? k : n, beta, c_i, n);
      continue;
    }
    for (int64_t k0 = 0; k0 < std::max<int64_t>(k, 1); k0 += panel_k) {  // k = 0 still applies beta
      const int64_t kb = std::min(panel_k, k - k0);
      Panel pa = k_panel(types.a, a_i, !trans_a, m, k, k0, kb, a_panel);
      Panel pb = k_panel(types.b, b_i, trans_b, n, k, k0, kb, b_panel);
      cpu_sgemm(trans_a, trans_b, m, n, kb, alpha, pa.data, pa.ld, pb.data, pb.ld, k0 == 0 ? beta : 1.0f, c_i, n);
    }
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
