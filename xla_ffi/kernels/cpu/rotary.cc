#include <vector>

#include "kernels/rotary.h"

namespace jnntile {
namespace {

// Calls pair(first value's offset, cos, sin) for every pair of the tile, one cosine and sine per sequence
// row and frequency, shared by the row's heads and, unless positions are given per row, its batch rows.
template <class Pair>
void for_each_pair(const RotaryTile& t, Pair pair) {
  const int64_t half = t.d / 2;
  std::vector<float> cos_a(half), sin_a(half);
  for (int64_t r = 0; r < t.nt; ++r)
    for (int64_t b = 0; b < t.nb; ++b) {
      if (b == 0 || t.positions != nullptr)
        for (int64_t c = 0; c < half; ++c) {
          const float a = float(rotary::position(t, b, r)) * t.inv_freq[c];
          cos_a[c] = cosf(a);
          sin_a[c] = sinf(a);
        }
      for (int64_t h = 0; h < t.nh; ++h) {
        const int64_t head = ((b * t.nt + r) * t.nh + h) * t.d;
        for (int64_t c = 0; c < half; ++c) pair(head + c, head + c + half, cos_a[c], sin_a[c]);
      }
  }
}

}  // namespace

template <>
void rotary_forward<Device::Cpu>(FloatType type, const RotaryTile& t, const void* x, void* y) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    if (!t.rotate) {
      for (int64_t i = 0; i < rotary::numel(t); ++i) yt[i] = xt[i];
      return;
    }
    for_each_pair(t, [&](int64_t i, int64_t j, float cos_a, float sin_a) {
      float a, b;
      rotary::turn(to_float(xt[i]), to_float(xt[j]), cos_a, sin_a, a, b);
      yt[i] = from_float<T>(a);
      yt[j] = from_float<T>(b);
    });
  });
}

template <>
void rotary_backward<Device::Cpu>(FloatType type, const RotaryTile& t, const void* dy, void* dx) {
  visit_float(type, [&](auto tag) {
    using T = decltype(tag);
    const T* dyt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    if (!t.rotate) {
      for (int64_t i = 0; i < rotary::numel(t); ++i)
        dxt[i] = from_float<T>(rotary::backward_base(t, dxt, i) + to_float(dyt[i]));
      return;
    }
    for_each_pair(t, [&](int64_t i, int64_t j, float cos_a, float sin_a) {
      float a, b;
      rotary::turn(to_float(dyt[i]), to_float(dyt[j]), cos_a, -sin_a, a, b);
      dxt[i] = from_float<T>(rotary::backward_base(t, dxt, i) + a);
      dxt[j] = from_float<T>(rotary::backward_base(t, dxt, j) + b);
    });
  });
}

}  // namespace jnntile
