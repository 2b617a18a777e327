#include "kernels/values.h"

#include <algorithm>
#include <cstring>

namespace jnntile {
namespace {

template <class T>
void fill_host(int64_t n, T value, T* dst) {
  std::fill(dst, dst + n, value);
}

}  // namespace

template <>
void fill<Device::Cpu>(int64_t n, float value, float* dst) { fill_host(n, value, dst); }
template <>
void fill<Device::Cpu>(int64_t n, int32_t value, int32_t* dst) { fill_host(n, value, dst); }
template <>
void fill<Device::Cpu>(int64_t n, int64_t value, int64_t* dst) { fill_host(n, value, dst); }
template <>
void fill<Device::Cpu>(int64_t n, bfloat16 value, bfloat16* dst) { fill_host(n, value, dst); }
template <>
void fill<Device::Cpu>(int64_t n, uint8_t value, uint8_t* dst) { fill_host(n, value, dst); }

template <>
void convert<Device::Cpu>(int64_t n, FloatType from, const void* src, FloatType to, void* dst) {
  visit_float(from, [&](auto source_type) {
    visit_float(to, [&](auto target_type) {
      using S = decltype(source_type);
      using T = decltype(target_type);
      const S* s = static_cast<const S*>(src);
      T* d = static_cast<T*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = from_float<T>(to_float(s[i]));
    });
  });
}

template <>
void fill_random<Device::Cpu>(const TileGeometry& g, uint64_t seed, bool normal, float a, float b, float* tile) {
  int64_t length = g.row_length();
  for_each_row(g, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < length; ++i) tile[tile_start + i] = random_value(seed, global_start + i, normal, a, b);
  });
}

void copy_tile(const TileGeometry& g, size_t elem_size, bool to_tile, void* tile, void* array) {
  size_t row_bytes = size_t(g.row_length()) * elem_size;
  char* t = static_cast<char*>(tile);
  char* a = static_cast<char*>(array);
  for_each_row(g, [&](int64_t tile_start, int64_t global_start) {
    if (to_tile) std::memcpy(t + tile_start * elem_size, a + global_start * elem_size, row_bytes);
    else std::memcpy(a + global_start * elem_size, t + tile_start * elem_size, row_bytes);
  });
}

void add_to_tile(const TileGeometry& g, const float* array, float* tile) {
  int64_t length = g.row_length();
  for_each_row(g, [&](int64_t tile_start, int64_t global_start) {
    for (int64_t i = 0; i < length; ++i) tile[tile_start + i] += array[global_start + i];
  });
}

}  // namespace jnntile
