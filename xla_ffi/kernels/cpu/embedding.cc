#include "kernels/embedding.h"

#include <algorithm>
#include <cstring>

namespace jnntile {

template <>
void embedding_forward<Device::Cpu>(int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                                    const float* table, bool first, float* out) {
  for (int64_t p = 0; p < n; ++p) {
    int64_t row = embedding::row(ids[p], v0, vlen);
    float* dst = out + p * c;
    if (row >= 0) std::memcpy(dst, table + row * c, size_t(c) * sizeof(float));
    else if (first) std::fill(dst, dst + c, 0.0f);
  }
}

template <>
void embedding_backward<Device::Cpu>(int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                                     const float* dout, float* dtable) {
  for (int64_t p = 0; p < n; ++p) {
    int64_t row = embedding::row(ids[p], v0, vlen);
    if (row < 0) continue;
    float* dst = dtable + row * c;
    const float* src = dout + p * c;
    for (int64_t j = 0; j < c; ++j) dst[j] += src[j];
  }
}

}  // namespace jnntile
