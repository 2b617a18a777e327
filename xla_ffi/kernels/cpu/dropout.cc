#include "kernels/dropout.h"

namespace jnntile {

template <>
void dropout<Device::Cpu>(const TileGeometry& g, uint64_t seed, double rate, bool accumulate, const float* in,
                          float* out) {
  float scale = dropout_scale(rate);
  int64_t length = g.row_length();
  for_each_row(g, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < length; ++i) {
      float value = dropout_value(seed, global_start + i, rate, scale, in[tile_start + i]);
      out[tile_start + i] = accumulate ? out[tile_start + i] + value : value;
    }
  });
}

}  // namespace jnntile
