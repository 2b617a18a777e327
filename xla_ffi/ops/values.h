// Moving data between host arrays and tiled tensors (used by the FFI targets
// in ops/values.cc and by the direct Python API in module.cc). Both block until
// the copies are done, with the watchdog.
#pragma once
#include <cstdint>

#include "kernels/values.h"
#include "tensor.h"

namespace jnntile {

// A block of whole tiles: tiles lo[a] <= i < hi[a] on every axis a. Its
// elements, as a row-major array of their own, are the host side of a copy, so
// a tensor larger than RAM moves through a small host buffer block by block
// (checkpoints). Empty lo and hi mean every tile.
struct TileBox {
  Index lo, hi;
};

void write_from_host(int64_t id, void* data, int64_t nbytes, const TileBox& box = {});
// Adds a float32 host array into the tensor (the backward of reading it).
void add_from_host(int64_t id, void* data, int64_t nbytes);
void read_to_host(int64_t id, void* data, int64_t nbytes, const TileBox& box = {});

// Where tile `linear` of t lies in t, for kernels that need global element
// indices (copies to host arrays, random numbers, dropout masks).
TileGeometry tile_geometry(const TiledTensor& t, int64_t linear);

// Submits dst = n float32 zeros: one task, dst written whole.
void submit_zeros(starpu_data_handle_t dst, int64_t n);
// Submits dst = src converted (n elements, float types from and to): one task, dst written whole.
void submit_convert(starpu_data_handle_t src, FloatType from, starpu_data_handle_t dst, FloatType to, int64_t n);
}  // namespace jnntile
