#include "kernels/gemm.h"

#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/vectors.h"
#include "kernels/values.h"

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

}  // namespace

int64_t gemm_scratch_floats(GemmTypes types, int64_t batch, int64_t m, int64_t n, int64_t k) {
  // A bfloat16 C is summed in float32, rounded once; bfloat16 operands are converted into each worker's own
  // packed panels (below), not into the task's scratch.
  return types.c == FloatType::BF16 ? batch * m * n : 0;
}

// ---- products with bfloat16 operands, without a bfloat16 BLAS ------------------------------------------
//
// OpenBLAS 0.3.21 has no sbgemm. Widening bfloat16 operands into float32 for its sgemm costs a pass over each
// operand: bfloat16 products ran 1.00-1.07x the time of float32 ones (one core of an AVX2 AMD EPYC, GPT-2
// 124M's shapes), and a bfloat16 step 0.92-0.97x the float32 step's speed. Like BLIS and OpenBLAS, this
// product copies blocks of op(A) and op(B) into panels laid out for its register block before multiplying, and
// converts while it copies: a bfloat16 panel is half the bytes to read, and there is no other pass. The
// panels are float32 and the sums too, so the result is what the widened sgemm gives up to the order of
// additions. One core multiplies two 1024 x 1024 bfloat16 matrices at 91 GFLOP/s, OpenBLAS's sgemm two
// float32 ones at 92 (`bench/gemm.py --sizes 1024 --tiles 0 --dtypes float32 bfloat16 --workers 1`).
namespace {
namespace packed {

using namespace vectors;

// The register block: 6 rows x 16 columns of C in 12 vectors of 8 floats (with the 2 of B and the broadcast
// of A, 15 of the 16 AVX2 registers). Blocks: a kMc x kKc block of op(A) stays in L2 (144 KB), a kKc x 16
// column panel of op(B) in L1 (16 KB), the kKc x kNc block of op(B) in L3 (3 MB). On the AMD EPYC, kKc 384
// or 512 measured the same within the VM's noise.
constexpr int64_t kMr = 6, kNr = 16, kKc = 256, kMc = 144, kNc = 3072;

// r[i] holds row i of an 8 x 8 block; afterwards r[j] holds its column j (AVX2's unpack, shuffle and
// permute sequence, which GCC picks for these masks).
void transpose8(Floats8 r[8]) {
  const Ints8 lo{0, 8, 1, 9, 4, 12, 5, 13}, hi{2, 10, 3, 11, 6, 14, 7, 15};
  const Ints8 lo2{0, 1, 8, 9, 4, 5, 12, 13}, hi2{2, 3, 10, 11, 6, 7, 14, 15};
  const Ints8 low128{0, 1, 2, 3, 8, 9, 10, 11}, high128{4, 5, 6, 7, 12, 13, 14, 15};
  Floats8 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], lo);
    t[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], hi);
  }
  for (int i = 0; i < 2; ++i)
    for (int half = 0; half < 2; ++half) {
      u[4 * i + 2 * half] = __builtin_shuffle(t[4 * i + half], t[4 * i + 2 + half], lo2);
      u[4 * i + 2 * half + 1] = __builtin_shuffle(t[4 * i + half], t[4 * i + 2 + half], hi2);
    }
  // u[0..3] hold rows 0-3's pieces of columns (0,4), (1,5), (2,6), (3,7); u[4..7] those of rows 4-7.
  for (int j = 0; j < 4; ++j) {
    r[j] = __builtin_shuffle(u[j], u[4 + j], low128);
    r[4 + j] = __builtin_shuffle(u[j], u[4 + j], high128);
  }
}

// out[p * kMr + i] = rows[i][p] for p < kc: rows i >= `count` are zeros. Eight columns at a time, each
// stored as 8 floats: a store runs 2 floats into the next column, which the next store overwrites, and the
// last one into the panel after it (written later) or the buffer's slack.
template <class T>
void pack_rows(const T* const (&rows)[kMr], int64_t count, int64_t kc, float* out) {
  int64_t p = 0;
  for (; p + 8 <= kc; p += 8) {
    Floats8 r[8];
    for (int i = 0; i < 8; ++i) r[i] = i < count ? load8(rows[i] + p) : Floats8{};
    transpose8(r);
    for (int j = 0; j < 8; ++j) store8(out + (p + j) * kMr, r[j]);
  }
  for (; p < kc; ++p)
    for (int i = 0; i < kMr; ++i) out[p * kMr + i] = i < count ? to_float(rows[i][p]) : 0.0f;
}

// Rows [i0, i0 + mc) x columns [p0, p0 + kc) of op(A) (m x k) into panels of kMr rows, each kc x kMr with a
// row of A's kMr values per p. A is stored m x k (ld lda), or k x m when transposed.
template <class T>
void pack_a(const T* a, int64_t lda, bool trans, int64_t k, int64_t i0, int64_t mc, int64_t p0, int64_t kc,
            float* out) {
  for (int64_t ib = 0; ib < mc; ib += kMr, out += kMr * kc) {
    const int64_t mr = std::min(kMr, mc - ib);
    if (!trans) {
      const T* rows[kMr];
      for (int64_t i = 0; i < kMr; ++i) rows[i] = a + (i0 + ib + std::min(i, mr - 1)) * lda + p0;
      pack_rows(rows, mr, kc, out);
      continue;
    }
    for (int64_t p = 0; p < kc; ++p) {
      const T* src = a + (p0 + p) * lda + i0 + ib;
      // 8 loaded for 6: the 2 past them are the next panel's rows, or stored A's next row exists.
      if (mr == kMr && (ib + 8 <= mc || p0 + p + 1 < k)) store8(out + p * kMr, load8(src));
      else
        for (int64_t i = 0; i < kMr; ++i) out[p * kMr + i] = i < mr ? to_float(src[i]) : 0.0f;
    }
  }
}

// Rows [p0, p0 + kc) x columns [j0, j0 + nc) of op(B) (k x n) into panels of kNr columns, each kc x kNr.
// B is stored k x n (ld ldb), or n x k when transposed.
template <class T>
void pack_b(const T* b, int64_t ldb, bool trans, int64_t p0, int64_t kc, int64_t j0, int64_t nc, float* out) {
  for (int64_t jb = 0; jb < nc; jb += kNr, out += kNr * kc) {
    const int64_t nr = std::min(kNr, nc - jb);
    if (!trans) {
      for (int64_t p = 0; p < kc; ++p) {
        const T* src = b + (p0 + p) * ldb + j0 + jb;
        if (nr == kNr) {
          store8(out + p * kNr, load8(src));
          store8(out + p * kNr + 8, load8(src + 8));
        } else {
          for (int64_t j = 0; j < kNr; ++j) out[p * kNr + j] = j < nr ? to_float(src[j]) : 0.0f;
        }
      }
      continue;
    }
    // Stored B's rows are op(B)'s columns: two 8-column halves, each transposed 8 x 8 at a time.
    for (int64_t half = 0; half < kNr; half += 8) {
      const T* rows[8];
      for (int64_t j = 0; j < 8; ++j) rows[j] = b + (j0 + jb + std::min(half + j, nr - 1)) * ldb + p0;
      const int64_t count = std::max<int64_t>(0, std::min<int64_t>(8, nr - half));
      int64_t p = 0;
      for (; p + 8 <= kc; p += 8) {
        Floats8 r[8];
        for (int j = 0; j < 8; ++j) r[j] = j < count ? load8(rows[j] + p) : Floats8{};
        transpose8(r);
        for (int q = 0; q < 8; ++q) store8(out + (p + q) * kNr + half, r[q]);
      }
      for (; p < kc; ++p)
        for (int64_t j = 0; j < 8; ++j) out[p * kNr + half + j] = j < count ? to_float(rows[j][p]) : 0.0f;
    }
  }
}

// C (6 x 16, ld ldc) = alpha A B + beta C over kc: A a kc x 6 panel, B a kc x 16 panel. beta 0 reads no C.
void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, float alpha, float beta) {
  Floats8 sum[kMr][2] = {};
  for (int64_t i = 0; i < kMr; ++i) __builtin_prefetch(c + i * ldc);
#pragma GCC unroll 4
  for (int64_t p = 0; p < kc; ++p, a += kMr, b += kNr) {
    const Floats8 b0 = load8(b), b1 = load8(b + 8);
    for (int64_t i = 0; i < kMr; ++i) {
      const Floats8 ai = broadcast8(a[i]);
      sum[i][0] += ai * b0;
      sum[i][1] += ai * b1;
    }
  }
  for (int64_t i = 0; i < kMr; ++i)
    for (int h = 0; h < 2; ++h) {
      Floats8 value = alpha * sum[i][h];
      if (beta != 0.0f) value += beta * load8(c + i * ldc + 8 * h);
      store8(c + i * ldc + 8 * h, value);
    }
}

// C (m x n, ld ldc, float32) = alpha op(A) op(B) + beta C, with A and B of type T (float or bfloat16).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (k == 0) {  // alpha op(A) op(B) is zero; C still takes beta
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  // The worker's panels stay allocated between tasks; 8 floats of slack for pack_rows' last store.
  thread_local std::vector<float> a_panels(kMc * kKc + 8), b_panels(kKc * kNc);
  for (int64_t j0 = 0; j0 < n; j0 += kNc) {
    const int64_t nc = std::min(kNc, n - j0);
    for (int64_t p0 = 0; p0 < k; p0 += kKc) {
      const int64_t kc = std::min(kKc, k - p0);
      const float beta_block = p0 == 0 ? beta : 1.0f;  // later K blocks add to the first one's sums
      pack_b(b, ldb, trans_b, p0, kc, j0, nc, b_panels.data());
      for (int64_t i0 = 0; i0 < m; i0 += kMc) {
        const int64_t mc = std::min(kMc, m - i0);
        pack_a(a, lda, trans_a, k, i0, mc, p0, kc, a_panels.data());
        for (int64_t jr = 0; jr < nc; jr += kNr)
          for (int64_t ir = 0; ir < mc; ir += kMr) {
            const float *a_panel = a_panels.data() + ir * kc, *b_panel = b_panels.data() + jr * kc;
            float* c_block = c + (i0 + ir) * ldc + j0 + jr;
            const int64_t mr = std::min(kMr, mc - ir), nr = std::min(kNr, nc - jr);
            if (mr == kMr && nr == kNr) {
              micro_kernel(kc, a_panel, b_panel, c_block, ldc, alpha, beta_block);
              continue;
            }
            // An edge block goes through a full-size copy of the part of C that exists.
            float edge[kMr * kNr] = {};
            for (int64_t i = 0; i < mr; ++i)
              for (int64_t j = 0; j < nr; ++j) edge[i * kNr + j] = c_block[i * ldc + j];
            micro_kernel(kc, a_panel, b_panel, edge, kNr, alpha, beta_block);
            for (int64_t i = 0; i < mr; ++i)
              for (int64_t j = 0; j < nr; ++j) c_block[i * ldc + j] = edge[i * kNr + j];
          }
      }
    }
  }
}

}  // namespace packed
}  // namespace

// A bfloat16 C is summed in float32 scratch and rounded back once at the end.
template <>
void gemm<Device::Cpu>(GemmTypes types, bool trans_a, bool trans_b, int64_t batch, int64_t m, int64_t n, int64_t k,
                       float alpha, const void* a, const void* b, float beta, void* c, float* scratch) {
  float* c32 = types.c == FloatType::F32 ? static_cast<float*>(c) : scratch;
  if (types.c == FloatType::BF16 && beta != 0.0f) convert<Device::Cpu>(batch * m * n, types.c, c, FloatType::F32, c32);
  const int64_t lda = trans_a ? m : k, ldb = trans_b ? k : n;
  for (int64_t i = 0; i < batch; ++i) {
    float* c_i = c32 + i * m * n;
    if (types.a == FloatType::F32)
      cpu_sgemm(trans_a, trans_b, m, n, k, alpha, static_cast<const float*>(a) + i * m * k, lda,
                static_cast<const float*>(b) + i * k * n, ldb, beta, c_i, n);
    else
      cpu_bf16_gemm(trans_a, trans_b, m, n, k, alpha, static_cast<const bfloat16*>(a) + i * m * k, lda,
                    static_cast<const bfloat16*>(b) + i * k * n, ldb, beta, c_i, n);
  }
  if (types.c == FloatType::BF16) convert<Device::Cpu>(batch * m * n, FloatType::F32, c32, types.c, c);
}

void cpu_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  SgemmFn sgemm = mkl().sgemm != nullptr ? mkl().sgemm : openblas_sgemm;
  sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, int(m), int(n),
        int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

void cpu_bf16_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                   int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (mkl().bf16_gemm == nullptr) {
    packed::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
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
