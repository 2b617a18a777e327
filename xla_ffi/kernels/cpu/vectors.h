// Vectors of 8 floats (AVX2's width) in GCC's vector extensions, for the CPU loops GCC does not vectorise well
// on its own. No intrinsics: the same code builds for any target GCC vectorises for.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/values.h"

namespace jnntile::vectors {

using Floats8 = float __attribute__((vector_size(32)));
using Floats4 = float __attribute__((vector_size(16)));
using Doubles4 = double __attribute__((vector_size(32)));
using Ints8 = int32_t __attribute__((vector_size(32)));
using Halves8 = uint16_t __attribute__((vector_size(16)));

inline Floats8 load8(const float* x) {
  Floats8 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}
inline Floats8 load8(const bfloat16* x) {
  Halves8 h;
  std::memcpy(&h, x, sizeof h);
  return (Floats8)(__builtin_convertvector(h, Ints8) << 16);  // a bfloat16 is a float's upper half
}
inline void store8(float* x, Floats8 v) { std::memcpy(x, &v, sizeof v); }
// x in every lane (vbroadcastss; `Floats8{} + x` adds 0.0f first, an instruction on the FMA ports per use).
inline Floats8 broadcast8(float x) { return Floats8{x, x, x, x, x, x, x, x}; }

}  // namespace jnntile::vectors
