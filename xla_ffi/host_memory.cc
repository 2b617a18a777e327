// RAM tiles: StarPU allocates them through tile_malloc and tile_free (starpu_malloc_set_hooks).
#include "runtime_state.h"

#if JNNTILE_CUDA
#include "kernels/cuda/context.h"
#endif

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

namespace jnntile {
namespace {

// Tile memory comes straight from mmap and goes back to the system on free.
// With malloc, freed tiles stayed in glibc's arenas (one per thread, with a
// free threshold that grows with the largest chunk freed), so the process held
// hundreds of MB more than the memory limit: a 1.6 GB limit peaked at 2.3 GB
// of RSS, 2.0 GB with this. Small allocations keep using malloc. A pointer
// registry, not the size StarPU passes to free (starpu_free passes 0), tells
// which is which.
constexpr size_t kMmapThreshold = size_t(64) << 10;

// Page-locked tiles (runtime_config().pin_host_memory with a CUDA worker):
// StarPU's copies to and from the GPU are then asynchronous DMA.
std::atomic<bool> pin_tiles{false};

// swap_io_alignment(): the page size with the direct-I/O swap backend, whose
// reads and writes StarPU 1.3 asserts to be page-aligned and page multiples
// (disk_unistd_o_direct.c); its plug asks starpu_malloc for page alignment,
// which these hooks must honour themselves.
std::atomic<size_t> io_alignment{1};

struct MappedRegion {
  size_t size;
  bool pinned;  // only pinned regions are unpinned: a failed unpin would leave a CUDA error behind
};

struct MappedRegions {
  std::mutex mutex;
  std::unordered_map<void*, MappedRegion> regions;
};

// Page-locks a tile. A failure (the system's limit on locked memory, say) leaves the
// tile pageable, slower to copy but correct; CUDA keeps the error of a failed
// cudaHostRegister as the thread's last error, which the next kernel launch check
// would report as its own failure, so it is cleared here and reported once.
bool pin_tile(void* p, size_t size) {
  if (starpu_memory_pin(p, size) == 0) return true;
#if JNNTILE_CUDA
  const char* error = cuda::take_last_error();
#else
  const char* error = "unknown error";
#endif
  static std::atomic<bool> reported{false};
  if (!reported.exchange(true))
    std::fprintf(stderr,
                 "jnntile: could not page-lock a %zu-byte tile in RAM (%s); such tiles stay pageable, so their "
                 "copies to and from the GPU are synchronous. Raise the locked-memory limit (ulimit -l) or set "
                 "pin_host_memory=False.\n",
                 size, error);
  return false;
}

MappedRegions& mapped() {
  static MappedRegions* m = new MappedRegions();
  return *m;
}

int tile_malloc(unsigned, void** out, size_t size, int) {
  if (size >= kMmapThreshold) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return -ENOMEM;
    bool pinned = pin_tiles && pin_tile(p, size);
    MappedRegions& m = mapped();
    std::lock_guard<std::mutex> lock(m.mutex);
    m.regions.emplace(p, MappedRegion{size, pinned});
    *out = p;
    return 0;
  }
  void* p = nullptr;
  if (posix_memalign(&p, std::max<size_t>(64, io_alignment), size > 0 ? size : 1) != 0) return -ENOMEM;
  *out = p;
  return 0;
}

int tile_free(unsigned, void* ptr, size_t, int) {
  if (ptr == nullptr) return 0;
  MappedRegion region{0, false};
  {
    MappedRegions& m = mapped();
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.regions.find(ptr);
    if (it != m.regions.end()) {
      region = it->second;
      m.regions.erase(it);
    }
  }
  if (region.size > 0) {
    if (region.pinned && starpu_memory_unpin(ptr, region.size) != 0) {
#if JNNTILE_CUDA
      std::fprintf(stderr, "jnntile: could not unpin a %zu-byte tile (%s)\n", region.size, cuda::take_last_error());
#endif
    }
    munmap(ptr, region.size);
  } else {
    free(ptr);
  }
  return 0;
}

}  // namespace

void use_tile_allocator(const RuntimeConfig& config) {
  io_alignment = config.swap_dir.empty() || config.swap_backend == SwapBackend::Unistd ? 1 : size_t(getpagesize());
  starpu_malloc_set_hooks(tile_malloc, tile_free);
}

void pin_new_tiles(bool pin) { pin_tiles = pin; }

size_t swap_io_alignment() { return io_alignment; }

}  // namespace jnntile
