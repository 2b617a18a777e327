// Disk swap: a subdirectory of config.swap_dir per run, registered with StarPU as a disk memory node, whose
// space is reserved when the runtime starts (kSwapReserve).

// starpu_disk.h lacks the extern "C" guard the other StarPU headers have.
extern "C" {
#include <starpu_disk.h>
}
#include "runtime_state.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace jnntile {
namespace {

void remove_tree(const std::string& path) {
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    std::string child = path + "/" + name;
    struct stat st;
    if (lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(child);
    else unlink(child.c_str());
  }
  closedir(dir);
  rmdir(path.c_str());
}

// Swap subdirectories are named jnntile-swap-<pid>-XXXXXX (jnntile.runtime removes those of dead processes).
constexpr const char* kSwapPrefix = "jnntile-swap-";

// The disk swap's space is reserved when the runtime starts: a file of swap_size_mb in the swap subdirectory
// (kSwapReserve), which gives each tile file StarPU creates its blocks (alloc) and takes them back (free). StarPU's
// unistd backends create sparse files and write them asynchronously; a write that met a full disk (another
// process filled it) ended in StarPU's assertion on aio_error 28 and SIGABRT. Blocks allocated up front cannot run
// out: a tile file gets all its blocks when it is created, or the allocation fails here, where the runtime is
// marked failed with a message (waits then raise it) instead of aborting.
constexpr const char* kSwapReserve = "reserve";

// StarPU's unistd backends' object (src/core/disk_ops/unistd/disk_unistd_global.h, the same in StarPU 1.3.10 and
// 1.4): the file of one allocation, open (descriptor) or closed (-1) when too many are.
struct UnistdFile {
  int descriptor;
  char* path;
};

struct SwapSpace {
  std::mutex mutex;
  starpu_disk_ops ops;           // StarPU's backend with alloc and free wrapped; lives as long as the process
  const starpu_disk_ops* inner;  // StarPU's backend
  std::string dir;               // the swap subdirectory
  int reserve_fd = -1;
  int64_t reserved = 0;  // bytes the reserve file holds
  std::string failure;   // why a tile could not be allocated (swap_failure)
};

SwapSpace& swap_space() {
  static SwapSpace* s = new SwapSpace();
  return *s;
}

// The blocks a file of `size` bytes takes.
int64_t blocks_bytes(size_t size) {
  constexpr int64_t kBlock = 4096;
  return (int64_t(size) + kBlock - 1) / kBlock * kBlock;
}

int64_t free_bytes(const std::string& path) {
  struct statvfs fs;
  return statvfs(path.c_str(), &fs) == 0 ? int64_t(fs.f_bavail) * int64_t(fs.f_frsize) : -1;
}

// Callers hold swap_space().mutex. Moves `bytes` between the reserve file and the disk's free space.
void resize_reserve_locked(SwapSpace& sw, int64_t bytes) {
  int64_t target = std::max<int64_t>(0, sw.reserved + bytes);
  if (target < sw.reserved) {
    if (ftruncate(sw.reserve_fd, target) == 0) sw.reserved = target;
  } else if (target > sw.reserved && posix_fallocate(sw.reserve_fd, 0, target) == 0) {
    sw.reserved = target;  // else the reserve stays smaller: a later tile file takes its blocks from the disk
  }
}

void* swap_alloc(void* base, size_t size) {
  SwapSpace& sw = swap_space();
  const int64_t need = blocks_bytes(size);
  {
    std::lock_guard<std::mutex> lock(sw.mutex);
    resize_reserve_locked(sw, -need);
  }
  void* obj = sw.inner->alloc(base, size);
  int error = obj == nullptr ? errno : 0;
  if (obj != nullptr) {
    auto* file = static_cast<UnistdFile*>(obj);
    int fd = file->descriptor >= 0 ? file->descriptor : open(file->path, O_WRONLY);
    error = fd < 0 ? errno : posix_fallocate(fd, 0, off_t(size));
    if (fd >= 0 && file->descriptor < 0) close(fd);
    if (error != 0) {
      sw.inner->free(base, obj, size);
      obj = nullptr;
    }
  }
  if (obj != nullptr) return obj;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(sw.mutex);
    resize_reserve_locked(sw, need);
    if (sw.failure.empty()) {
      int64_t available = std::max<int64_t>(free_bytes(sw.dir), 0);
      sw.failure = "disk swap in " + sw.dir + " could not take a tile of " + std::to_string(size) + " bytes (" +
                   std::strerror(error ? error : EIO) + "; " + std::to_string(available) +
                   " bytes free there): another process took the disk space reserved for swap when the run started. "
                   "Free space there, or choose another --swap-dir (swap_dir)";
    }
    failure = sw.failure;
  }
  runtime_fail(failure);  // outside the swap's lock: runtime_stop holds the runtime's while StarPU frees tiles
  return nullptr;
}

void swap_free(void* base, void* obj, size_t size) {
  SwapSpace& sw = swap_space();
  sw.inner->free(base, obj, size);
  std::lock_guard<std::mutex> lock(sw.mutex);
  resize_reserve_locked(sw, blocks_bytes(size));
}

// Reserves `bytes` in `dir` for swap; returns StarPU's backend `inner` with its allocations drawn from the
// reserve, or nullptr (errno set) when the disk cannot hold them.
starpu_disk_ops* reserve_swap(const std::string& dir, int64_t bytes, const starpu_disk_ops* inner) {
  SwapSpace& sw = swap_space();
  std::lock_guard<std::mutex> lock(sw.mutex);
  if (sw.reserve_fd >= 0) close(sw.reserve_fd);
  sw.dir = dir;
  sw.reserved = 0;
  sw.failure.clear();
  sw.reserve_fd = open((dir + "/" + kSwapReserve).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (sw.reserve_fd < 0) return nullptr;
  if (int error = posix_fallocate(sw.reserve_fd, 0, bytes); error != 0) {
    errno = error;
    return nullptr;
  }
  sw.reserved = bytes;
  sw.inner = inner;
  sw.ops = *inner;
  sw.ops.alloc = swap_alloc;
  sw.ops.free = swap_free;
  return &sw.ops;
}

}  // namespace

void open_swap(const RuntimeConfig& config) {
  if (mkdir(config.swap_dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw std::runtime_error("cannot create swap directory '" + config.swap_dir + "'");
  std::string pattern = config.swap_dir + "/" + kSwapPrefix + std::to_string(getpid()) + "-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr)
    throw std::runtime_error("cannot create a swap subdirectory in '" + config.swap_dir +
                             "': check that it is writable");
  int64_t bytes = config.swap_size_mb * (int64_t(1) << 20);
  bool direct = config.swap_backend == SwapBackend::UnistdODirect;
  starpu_disk_ops* ops =
      reserve_swap(buf.data(), bytes, direct ? &starpu_disk_unistd_o_direct_ops : &starpu_disk_unistd_ops);
  if (ops == nullptr) {
    std::string why = std::strerror(errno);
    throw std::runtime_error("cannot reserve " + std::to_string(config.swap_size_mb) + " MB of swap in '" +
                             config.swap_dir + "' (" + why + "; " + std::to_string(free_bytes(config.swap_dir) >> 20) +
                             " MB free there): free space there, lower swap_size_mb or choose another swap_dir");
  }
  // The subdirectory's name lives in swap_space() until close_swap, as long as StarPU uses it.
  if (starpu_disk_register(ops, (void*)swap_space().dir.c_str(), bytes) < 0)
    throw std::runtime_error("StarPU could not register disk swap in '" + config.swap_dir + "' of " +
                             std::to_string(config.swap_size_mb) + " MB" +
                             (direct ? " with direct I/O: its file system may not allow O_DIRECT; use "
                                       "swap_backend='unistd' or a directory on another file system"
                                     : ""));
}

void close_swap() {
  SwapSpace& sw = swap_space();
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(sw.mutex);
    if (sw.reserve_fd >= 0) close(sw.reserve_fd);
    sw.reserve_fd = -1;
    sw.reserved = 0;
    std::swap(dir, sw.dir);
  }
  if (!dir.empty()) remove_tree(dir);
}

std::string swap_failure() {
  SwapSpace& sw = swap_space();
  std::lock_guard<std::mutex> lock(sw.mutex);
  return sw.failure;
}
}  // namespace jnntile
