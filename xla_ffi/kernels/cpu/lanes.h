// Sums over a row on the CPU in independent running sums ("lanes", as a GPU
// warp's): one running sum waits on each addition's latency (a double add
// every 4 cycles), eight independent ones vectorise. Element j goes to lane
// j % kLanes and the lanes are added in order at the end, so a result
// repeats bit for bit.
#pragma once
#include <math.h>
#include <stdint.h>

namespace jnntile {

constexpr int64_t kLanes = 8;

// The sum of term(j) for j in [0, n), in double.
template <class Term>
double lane_sum(int64_t n, Term term) {
  double lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lanes[k] += term(j + k);
  for (int64_t k = 0; j < n; ++j, ++k) lanes[k] += term(j);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

// The largest term(j) for j in [0, n) (-inf when n = 0), in sixteen running maxima: a float max is
// exact, so their order does not show in the result.
template <class Term>
float lane_max(int64_t n, Term term) {
  constexpr int64_t kMaxLanes = 16;
  float lanes[kMaxLanes];
  for (float& lane : lanes) lane = -INFINITY;
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes)
    for (int64_t k = 0; k < kMaxLanes; ++k) lanes[k] = lanes[k] > term(j + k) ? lanes[k] : term(j + k);
  for (int64_t k = 0; j < n; ++j, ++k) lanes[k] = lanes[k] > term(j) ? lanes[k] : term(j);
  float m = -INFINITY;
  for (float lane : lanes) m = m > lane ? m : lane;
  return m;
}

}  // namespace jnntile
