#include "kernels/cpu/dropout.h"

#include "kernels/cpu/data.h"

namespace jnntile::cpu {
namespace {
// Separates dropout's stream from random_f32's when a seed is reused for both.
constexpr uint64_t kDropoutStream = 0xD60F0A7E5EEDull;
}  // namespace

void dropout(int ndim, const int64_t* shape, const int64_t* offset, const int64_t* extent, uint64_t seed,
             double rate, bool accumulate, const float* in, float* out) {
  float scale = float(1.0 / (1.0 - rate));
  int64_t row_len = ndim == 0 ? 1 : extent[ndim - 1];
  for_each_row(ndim, shape, offset, extent, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < row_len; ++i) {
      bool keep = uniform01(seed ^ kDropoutStream, uint64_t(global_start + i)) >= rate;
      float value = keep ? in[tile_start + i] * scale : 0.0f;
      out[tile_start + i] = accumulate ? out[tile_start + i] + value : value;
    }
  });
}

}  // namespace jnntile::cpu
