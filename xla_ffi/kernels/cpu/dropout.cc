#include "kernels/dropout.h"

namespace jnntile {

template <>
void dropout<Device::Cpu>(FloatType type, const TileGeometry& g, uint64_t seed, double rate, bool accumulate,
                          const void* in, void* out) {
  float scale = dropout_scale(rate);
  int64_t length = g.row_length();
  visit_float(type, [&](auto t) {
    using T = decltype(t);
    const T* x = static_cast<const T*>(in);
    T* y = static_cast<T*>(out);
    for_each_row(g, [&](int64_t tile_start, int64_t global_start) {
      for (int64_t i = 0; i < length; ++i) {
        float value = dropout_value(seed, global_start + i, rate, scale, to_float(x[tile_start + i]));
        y[tile_start + i] = from_float<T>(accumulate ? to_float(y[tile_start + i]) + value : value);
      }
    });
  });
}

}  // namespace jnntile
