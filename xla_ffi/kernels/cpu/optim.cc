#include "kernels/cpu/optim.h"

#include <cmath>

namespace jnntile::cpu {

void adamw(int64_t n, float* p, const float* g, float* m, float* v, float lr, float b1, float b2, float eps,
           float weight_decay, float bc1, float bc2) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    float update = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps) + weight_decay * p[i];
    p[i] -= lr * update;
  }
}

void sgd(int64_t n, float* p, const float* g, float lr) {
  for (int64_t i = 0; i < n; ++i) p[i] -= lr * g[i];
}

void scale_in_place(int64_t n, float* x, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace jnntile::cpu
