// Embedding lookup and its scatter-add backward on one tile pair: which table
// row an id names, and the family's entry points.
//
// A task sees one vocabulary tile of the table: rows [v0, v0 + vlen) and `c`
// columns. Ids outside that range belong to another task (or to no task at all
// when they are outside the vocabulary), so they are never used as offsets:
// a bad id can give a zero row, never an out-of-bounds access.
#pragma once
#include "kernels/device.h"

namespace jnntile {
namespace embedding {

// The row of `id` in the table rows [v0, v0 + vlen), or -1 when it is not there.
JNNTILE_HD int64_t row(int32_t id, int64_t v0, int64_t vlen) {
  int64_t r = int64_t(id) - v0;
  return r >= 0 && r < vlen ? r : -1;
}

}  // namespace embedding

// out and dout are tiles of `type` (float32 or bfloat16). The table is a float32 master or, frozen, a
// bfloat16 base (`table_type`); a table's gradient is float32 (a bfloat16 table has none).

// ids: (n,)  table: (vlen, c)  out: (n, c)
// out[p] = table[ids[p] - v0] for ids in [v0, v0 + vlen). Other rows are set to
// zero when `first` (the write-only first pass over the output tile) and left
// as they are otherwise (another vocabulary tile fills them).
template <Device D>
void embedding_forward(FloatType table_type, FloatType type, int64_t n, int64_t c, int64_t v0, int64_t vlen,
                       const int32_t* ids, const void* table, bool first, void* out);

// ids: (n,)  dout: (n, c)  dtable: (vlen, c)
// dtable[ids[p] - v0] += dout[p] for ids in [v0, v0 + vlen); repeated ids add
// up in id order, so every element of dtable gets its terms in the same order
// on every device and every run.
template <Device D>
void embedding_backward(FloatType type, int64_t n, int64_t c, int64_t v0, int64_t vlen, const int32_t* ids,
                        const void* dout, float* dtable);

}  // namespace jnntile
