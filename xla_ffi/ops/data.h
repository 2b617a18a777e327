// Moving data between host arrays and tiled tensors (used by the FFI targets
// in ops/data.cc and by the direct Python API in module.cc). Both block until
// the copies are done, with the watchdog.
#pragma once
#include <cstdint>

#include "kernels/data.h"
#include "tensor.h"

namespace jnntile {
void write_from_host(int64_t id, void* data, int64_t nbytes);
// Adds a float32 host array into the tensor (the backward of reading it).
void add_from_host(int64_t id, void* data, int64_t nbytes);
void read_to_host(int64_t id, void* data, int64_t nbytes);

// Where tile `linear` of t lies in t, for kernels that need global element
// indices (copies to host arrays, random numbers, dropout masks).
TileGeometry tile_geometry(const TiledTensor& t, int64_t linear);
}  // namespace jnntile
