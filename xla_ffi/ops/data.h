// Moving data between host arrays and tiled tensors (used by the FFI targets
// in ops/data.cc and by the direct Python API in module.cc). Both block until
// the copies are done, with the watchdog.
#pragma once
#include <cstdint>

namespace jnntile {
void write_from_host(int64_t id, void* data, int64_t nbytes);
// Adds a float32 host array into the tensor (the backward of reading it).
void add_from_host(int64_t id, void* data, int64_t nbytes);
void read_to_host(int64_t id, void* data, int64_t nbytes);
}  // namespace jnntile
