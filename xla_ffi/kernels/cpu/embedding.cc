#include "kernels/cpu/embedding.h"

#include <algorithm>
#include <cstring>

namespace jnntile::cpu {

void embedding_forward(int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                       const float* table, bool first, float* out) {
  for (int64_t p = 0; p < n; ++p) {
    int64_t row = int64_t(ids[p]) - v0;
    float* dst = out + p * c;
    if (row >= 0 && row < vlen) std::memcpy(dst, table + row * c, size_t(c) * sizeof(float));
    else if (first) std::fill(dst, dst + c, 0.0f);
  }
}

void embedding_backward(int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                        const float* dout, float* dtable) {
  for (int64_t p = 0; p < n; ++p) {
    int64_t row = int64_t(ids[p]) - v0;
    if (row < 0 || row >= vlen) continue;
    float* dst = dtable + row * c;
    const float* src = dout + p * c;
    for (int64_t j = 0; j < c; ++j) dst[j] += src[j];
  }
}

}  // namespace jnntile::cpu
