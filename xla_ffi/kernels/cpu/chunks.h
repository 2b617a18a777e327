// bfloat16 element loops on the CPU, a chunk at a time through float buffers: the inputs' elements widened,
// the loop's float32 instantiation run on them, the outputs rounded back. Fused into one loop, GCC vectorised
// a bfloat16 kernel 16 elements at a time with more live vectors than AVX2 has registers, and the rounding's
// NaN test among them: GELU's backward took 2.4 ns per element in bfloat16 against 1.5 in float32, the
// cross-entropy gradient 1.6 against 0.7 (one core of an AMD EPYC); in chunks, 2.1 and 1.0.
#pragma once
#include <algorithm>
#include <tuple>
#include <type_traits>

#include "kernels/values.h"

namespace jnntile {

constexpr int64_t kFloatChunk = 256;

// Rounds a chunk of floats into bfloat16 in an inline loop, not a call of convert<>: its dtype dispatch and
// aliasing checks per chunk of 256 cost 10% of a bfloat16 accumulate (0.54 -> 0.49 ns per element, GELU's
// forward 1.57 -> 1.52, one core of an AMD EPYC). Widening is the same loop the other way.
inline void round_chunk(int64_t n, const float* from, bfloat16* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = from_float<bfloat16>(from[i]);
}
inline void widen_chunk(int64_t n, const bfloat16* from, float* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = to_float(from[i]);
}

// An argument as the float loop sees it over the chunk that `load` names: a bfloat16 tile's elements widened
// into a buffer (an output's rounded back by `flush`), a float tile's in place, anything else as it is.
template <class Arg>
struct ChunkArg {
  Arg arg;
  void load(int64_t, int64_t) {}
  Arg view() { return arg; }
  void flush() {}
};
template <class T>
struct ChunkArg<T*> {
  static constexpr bool kWidened = std::is_same_v<std::remove_const_t<T>, bfloat16>;
  using Float = std::conditional_t<std::is_const_v<T>, const float, float>;
  T* tile;
  int64_t begin = 0, len = 0;
  alignas(32) float widened[kWidened ? kFloatChunk : 1];
  // An output is widened too: a kernel may add into it (where it overwrites, it reads nothing).
  void load(int64_t b, int64_t n) {
    begin = b;
    len = n;
    if constexpr (kWidened)
      if (tile != nullptr) widen_chunk(len, tile + begin, widened);
  }
  auto view() {
    if constexpr (kWidened) return tile == nullptr ? nullptr : static_cast<Float*>(widened);
    else return tile == nullptr ? nullptr : tile + begin;
  }
  void flush() {
    if constexpr (kWidened && !std::is_const_v<T>)
      if (tile != nullptr) round_chunk(len, widened, tile + begin);
  }
};

template <class... Args>
constexpr bool any_bfloat16 = ((std::is_same_v<Args, const bfloat16*> || std::is_same_v<Args, bfloat16*>) || ...);

// Calls loop(begin, len, args'...) for chunks [begin, begin + len) of [0, n), where args' are the pointer
// arguments advanced to the chunk's first element (bfloat16 ones as float buffers) and the others as they are.
// Without bfloat16 arguments, one chunk: [0, n) itself.
template <class Loop, class... Args>
void for_float_chunks(int64_t n, Loop loop, Args... args) {
  if constexpr (!any_bfloat16<Args...>) {
    loop(int64_t{0}, n, args...);
  } else {
    std::tuple<ChunkArg<Args>...> chunk{ChunkArg<Args>{args}...};
    std::apply(
        [&](auto&... arg) {
          for (int64_t begin = 0; begin < n; begin += kFloatChunk) {
            const int64_t len = std::min(kFloatChunk, n - begin);
            (arg.load(begin, len), ...);
            loop(begin, len, arg.view()...);
            (arg.flush(), ...);
          }
        },
        chunk);
  }
}

}  // namespace jnntile
