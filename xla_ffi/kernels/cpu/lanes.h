// Sums over a row on the CPU in independent running sums ("lanes", as a GPU
// warp's): one running sum waits on each addition's latency (a double add
// every 4 cycles), eight independent ones vectorise. Element j goes to lane
// j % kLanes and the lanes are added in order at the end, so a result
// repeats bit for bit.
#pragma once
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

}  // namespace jnntile
