#include "kernels/embedding.h"

namespace jnntile {

template <>
void embedding_forward<Device::Cpu>(FloatType table_type, FloatType type, int64_t n, int64_t c, int64_t v0,
                                    int64_t vlen, const int32_t* ids, const void* table, bool first, void* out) {
  visit_float(table_type, [&](auto tt) {
    visit_float(type, [&](auto t) {
      using T = decltype(t);
      const auto* rows = static_cast<const decltype(tt)*>(table);
      for (int64_t p = 0; p < n; ++p) {
        int64_t row = embedding::row(ids[p], v0, vlen);
        T* dst = static_cast<T*>(out) + p * c;
        if (row >= 0) {
          for (int64_t j = 0; j < c; ++j) dst[j] = from_float<T>(to_float(rows[row * c + j]));
        } else if (first) {
          for (int64_t j = 0; j < c; ++j) dst[j] = from_float<T>(0.0f);
        }
      }
    });
  });
}

template <>
void embedding_backward<Device::Cpu>(FloatType type, int64_t n, int64_t c, int64_t v0, int64_t vlen,
                                     const int32_t* ids, const void* dout, float* dtable) {
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    for (int64_t p = 0; p < n; ++p) {
      int64_t row = embedding::row(ids[p], v0, vlen);
      if (row < 0) continue;
      float* dst = dtable + row * c;
      const T* src = static_cast<const T*>(dout) + p * c;
      for (int64_t j = 0; j < c; ++j) dst[j] += to_float(src[j]);
    }
  });
}

}  // namespace jnntile
