// exp and tanh for the element loops of the kernels, on the CPU and the GPU.
//
// glibc's tanhf takes 9-16 ns per element here and its expf 1.6 ns, and
// neither vectorises: GELU's tanh was 13% of a GPT-2 124M step. These are
// branch-free polynomials that GCC vectorises (0.2 ns and 0.3 ns per element
// with AVX-512), within 1e-7 (exp) and 3.3e-7 (tanh) relative of the true
// values. The GPU runs the same arithmetic, so CPU tests check what it computes.
#pragma once
#include <math.h>
#include <stdint.h>

#include "kernels/device.h"

namespace jnntile {

JNNTILE_HD float float_from_bits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  return __builtin_bit_cast(float, bits);
#endif
}

// e^x for finite x (results below 2^-126 flush to zero; above FLT_MAX clamp).
// x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite), e^r by Cephes' polynomial,
// 2^n by building the exponent bits.
JNNTILE_HD float exp_approx(float x) {
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.3365447504019f ? -87.3365447504019f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, and vectorises
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * float_from_bits((int32_t(n) + 127) << 23);
}

// tanh(u) = sign(u) (1 - e) / (1 + e) with e = e^(-2|u|); below |u| = 1/16,
// where 1 - e cancels, its odd Taylor series.
JNNTILE_HD float tanh_approx(float u) {
  const float a = u < 0.0f ? -u : u;
  const float e = exp_approx(-2.0f * a);
  const float u2 = u * u;
  const float series = a * (1.0f + u2 * (-1.0f / 3.0f + u2 * (2.0f / 15.0f + u2 * (-17.0f / 315.0f))));
  const float t = a < 0.0625f ? series : (1.0f - e) / (1.0f + e);
  return u < 0.0f ? -t : t;
}

}  // namespace jnntile
