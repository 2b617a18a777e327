// What the CPU and the CUDA kernels share.
//
// Each op family has one header, kernels/<family>.h, holding the arithmetic of
// one element, one row or one reduction step as JNNTILE_HD functions (host and
// device code), and the entry points of the family as function templates over
// Device. kernels/cpu/<family>.cc defines the Device::Cpu instances (loops on
// the host), kernels/cuda/<family>.cu the Device::Cuda ones (launch code on
// StarPU's stream of the calling CUDA worker). The CPU tests thus run the same
// arithmetic the GPU runs. No CUDA type appears in these headers, so the C++
// files that include them build without the CUDA toolkit.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

// 1 where StarPU has CUDA and the CUDA kernels are built (CMakeLists.txt).
#ifndef JNNTILE_CUDA
#define JNNTILE_CUDA 0
#endif

#if defined(__CUDACC__)
#define JNNTILE_HD __host__ __device__ inline
#else
#define JNNTILE_HD inline
#endif

namespace jnntile {

enum class Device { Cpu, Cuda };

// ---- element types ------------------------------------------------------------
//
// Floating tiles hold float32 or bfloat16. Kernels load either into float, compute in float and store
// back rounding to nearest even, on the host and on the GPU alike; entry points take the tiles as void
// pointers with their FloatType, and `visit_float` instantiates the typed body once per type.

enum class FloatType : int { F32 = 0, BF16 = 1 };

// The upper half of a float32: same exponent range, 8 bits of mantissa.
struct bfloat16 {
  uint16_t bits;
};

JNNTILE_HD float to_float(float x) { return x; }
JNNTILE_HD float to_float(bfloat16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

template <class T>
JNNTILE_HD T from_float(float x);
template <>
JNNTILE_HD float from_float<float>(float x) {
  return x;
}
// Round to nearest, ties to even; a NaN stays a (quiet) NaN. Both results are 32-bit values chosen by a
// float compare and then shifted once: selected after the shift, in 16-bit lanes, the NaN test made a
// vectorised rounding loop 1.7x slower on AVX2.
template <>
JNNTILE_HD bfloat16 from_float<bfloat16>(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const uint32_t quiet_nan = u | 0x400000u;
  return bfloat16{uint16_t((x != x ? quiet_nan : rounded) >> 16)};
}

// Calls body(T{}) with T the C++ type of `type` (float or bfloat16): one typed body, instantiated per type.
template <class Body>
void visit_float(FloatType type, Body&& body) {
  if (type == FloatType::BF16) body(bfloat16{});
  else body(float{});
}

// Calls body(std::true_type{}) or body(std::false_type{}): a flag that a loop in the body tests per element
// is then a constant of each instantiation (tested at run time, it can keep the loop from vectorising).
template <class Body>
void visit_flag(bool flag, Body&& body) {
  if (flag) body(std::true_type{});
  else body(std::false_type{});
}

}  // namespace jnntile
