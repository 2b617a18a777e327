#pragma once
#include <cstdint>

namespace jnntile::cpu {
// One AdamW step on n elements, as optax.adamw: m, v moments; bias corrections
// bc1 = 1 - b1^t, bc2 = 1 - b2^t; decoupled weight decay; p -= lr * update.
void adamw(int64_t n, float* p, const float* g, float* m, float* v, float lr, float b1, float b2, float eps,
           float weight_decay, float bc1, float bc2);
// p -= lr * g
void sgd(int64_t n, float* p, const float* g, float lr);
// x *= factor
void scale_in_place(int64_t n, float* x, float factor);
}  // namespace jnntile::cpu
