#include "distributed.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "format.h"
#include "runtime.h"

#if JNNTILE_MPI
#include <starpu_mpi.h>
#endif

namespace jnntile {

#if JNNTILE_MPI

namespace {

struct Mpi {
  std::mutex mutex;
  MPI_Comm host = MPI_COMM_NULL;  // host exchanges, apart from StarPU-MPI's MPI_COMM_WORLD traffic
  MPI_Comm beat = MPI_COMM_NULL;  // pings answered by the heartbeat thread
  std::thread heartbeat;
  std::atomic<bool> beating{false};
  int rank = 0;
  int size = 1;
  bool initialized_here = false;  // MPI_Init_thread was ours, so MPI_Finalize is too
  bool abandoned = false;
  int exchange = 0;  // tag of the next host exchange
  std::unique_ptr<std::atomic<int64_t>[]> receiving;  // outstanding tile receives per source rank
  std::atomic<int64_t> bytes_sent{0};
};

Mpi& mpi() {
  static Mpi* m = new Mpi();  // never destroyed: StarPU-MPI's callbacks may outlive statics
  return *m;
}

void check(int ret, const std::string& what) {
  if (ret == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(ret, text, &length);
  throw std::runtime_error("MPI failed in " + what + ": " + std::string(text, size_t(length)));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

constexpr int kPing = 1, kPong = 2;
// How long a live rank may take to answer a ping: its heartbeat thread wakes every 10 ms.
constexpr double kPingTimeoutS = 2.0;

// Answers pings while the process lives (a stopped or dead process does not): a
// rank whose work is stuck can then tell a dead peer from a live one. Sleeps
// between probes, so it costs no core.
void heartbeat_loop() {
  Mpi& m = mpi();
  while (m.beating) {
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kPing, m.beat, &flag, &status);
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    MPI_Recv(nullptr, 0, MPI_BYTE, status.MPI_SOURCE, kPing, m.beat, MPI_STATUS_IGNORE);
    MPI_Request pong;
    MPI_Isend(nullptr, 0, MPI_BYTE, status.MPI_SOURCE, kPong, m.beat, &pong);
    MPI_Request_free(&pong);
  }
}

// The other ranks that do not answer a ping within kPingTimeoutS. Used once,
// after a failure: requests to dead ranks are left behind.
std::vector<int> unresponsive_ranks() {
  Mpi& m = mpi();
  std::vector<MPI_Request> pongs(size_t(m.size), MPI_REQUEST_NULL);
  for (int r = 0; r < m.size; ++r) {
    if (r == m.rank) continue;
    MPI_Request ping;
    MPI_Isend(nullptr, 0, MPI_BYTE, r, kPing, m.beat, &ping);
    MPI_Request_free(&ping);
    MPI_Irecv(nullptr, 0, MPI_BYTE, r, kPong, m.beat, &pongs[size_t(r)]);
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<int> silent;
  while (true) {
    silent.clear();
    for (int r = 0; r < m.size; ++r) {
      int done = 1;
      if (pongs[size_t(r)] != MPI_REQUEST_NULL) MPI_Test(&pongs[size_t(r)], &done, MPI_STATUS_IGNORE);
      if (!done) silent.push_back(r);
    }
    if (silent.empty() ||
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kPingTimeoutS)
      return silent;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Why `waited_for` ranks never came, from who answers a ping now.
std::string blame(const std::vector<int>& waited_for) {
  std::vector<int> silent = unresponsive_ranks();
  if (!silent.empty())
    return rank_list(silent) + (silent.size() == 1 ? " does" : " do") +
           " not answer: died or stopped (its own output, or mpirun's, may say why)";
  return "every rank answers, so " + rank_list(waited_for) + (waited_for.size() == 1 ? " runs" : " run") +
         " other steps than this one (every rank must run the same program) or waits elsewhere (its own error "
         "says where). Raise watchdog_s if they are only slow";
}

}  // namespace

bool mpi_available() { return true; }

std::string mpi_unavailable_reason() { return ""; }

std::pair<int, int> mpi_world() {
  Mpi& m = mpi();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (m.host != MPI_COMM_NULL) return {m.rank, m.size};
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw std::runtime_error("MPI was finalised in this process; distributed training needs a new one");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    m.initialized_here = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    throw std::runtime_error("the MPI library gives thread level " + std::to_string(provided) +
                             "; jnntile needs MPI_THREAD_MULTIPLE (its host exchanges run beside StarPU-MPI's "
                             "thread): use an MPI built with thread support, e.g. Debian's Open MPI");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &m.host), "MPI_Comm_dup");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &m.beat), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(m.host, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(m.beat, MPI_ERRORS_RETURN);
  MPI_Comm_rank(m.host, &m.rank);
  MPI_Comm_size(m.host, &m.size);
  m.receiving.reset(new std::atomic<int64_t>[size_t(m.size)]);
  for (int r = 0; r < m.size; ++r) m.receiving[r] = 0;
  m.beating = true;
  m.heartbeat = std::thread(heartbeat_loop);
  return {m.rank, m.size};
}

bool mpi_initialized() { return mpi().host != MPI_COMM_NULL; }

void mpi_finalize() {
  Mpi& m = mpi();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (m.host == MPI_COMM_NULL || m.abandoned) return;
  m.beating = false;
  m.heartbeat.join();
  MPI_Comm_free(&m.beat);
  MPI_Comm_free(&m.host);
  m.host = MPI_COMM_NULL;
  if (m.initialized_here) MPI_Finalize();
}

void mpi_abort(int code) {
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; should it, leave anyway
}

int distributed_starpu_init(starpu_conf* conf) {
  mpi_world();
  Mpi& m = mpi();
  m.bytes_sent = 0;
  for (int r = 0; r < m.size; ++r) m.receiving[r] = 0;
  // MPI is ours (initialize_mpi = 0): it outlives StarPU, which may be restarted in the process.
  return starpu_mpi_init_conf(nullptr, nullptr, 0, MPI_COMM_WORLD, conf);
}

void distributed_starpu_shutdown(double timeout_s) {
  try {
    allgather("", "runtime stop", timeout_s, /*patient=*/true);
  } catch (...) {
    distributed_abandon();
    throw;
  }
  starpu_mpi_shutdown();  // collective too: waits for the tasks and transfers of every rank
}

void distributed_abandon() {
  Mpi& m = mpi();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.abandoned = true;
}

std::vector<std::string> allgather(const std::string& mine, const std::string& what, double timeout_s,
                                   bool patient) {
  auto [rank, size] = mpi_world();
  Mpi& m = mpi();
  std::vector<std::string> out(static_cast<size_t>(size));
  out[size_t(rank)] = mine;
  if (size == 1) return out;
  // Exchanges follow one another on every rank, so a rolling tag keeps a late
  // message of an abandoned one from matching the next.
  const int tag = m.exchange;
  m.exchange = (m.exchange + 1) % 32768;  // MPI guarantees tags up to 32767
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    sends.emplace_back();
    check(MPI_Isend(mine.data(), int(mine.size()), MPI_BYTE, r, tag, m.host, &sends.back()),
          "a send to rank " + std::to_string(r) + " (" + what + ")");
  }
  std::vector<bool> received(static_cast<size_t>(size), false);
  received[size_t(rank)] = true;
  auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(20);
  while (true) {
    bool all = true;
    for (int r = 0; r < size; ++r) {
      if (received[size_t(r)]) continue;
      int flag = 0;
      MPI_Status status;
      check(MPI_Iprobe(r, tag, m.host, &flag, &status), "a probe of rank " + std::to_string(r) + " (" + what + ")");
      if (!flag) {
        all = false;
        continue;
      }
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      out[size_t(r)].resize(size_t(count));
      check(MPI_Recv(&out[size_t(r)][0], count, MPI_BYTE, r, tag, m.host, MPI_STATUS_IGNORE),
            "a receive from rank " + std::to_string(r) + " (" + what + ")");
      received[size_t(r)] = true;
    }
    int sent = 0;
    check(MPI_Testall(int(sends.size()), sends.data(), &sent, MPI_STATUSES_IGNORE), "sends (" + what + ")");
    if (all && sent) return out;
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_s) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r)
        if (!received[size_t(r)]) missing.push_back(r);
      if (patient && !missing.empty() && unresponsive_ranks().empty()) {
        start = std::chrono::steady_clock::now();  // they live: they are busy elsewhere, wait on
        continue;
      }
      std::string msg = "rank " + std::to_string(rank) + " waited " + seconds_str(waited) + " s for " +
                        (missing.empty() ? "its messages to be taken at " + what + "."
                                         : rank_list(missing) + " at " + what + "; " + blame(missing) + ".");
      distributed_abandon();
      runtime_fail(msg);  // the transfers of tiles with those ranks will not complete either
      throw std::runtime_error(msg);
    }
    // Sleep while waiting: a blocking MPI call would poll, spinning a core (DESIGN invariant 5).
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}

void transfer_posted(int source, int64_t bytes_sent) {
  Mpi& m = mpi();
  begin_pending();
  if (source >= 0) m.receiving[source] += 1;
  m.bytes_sent += bytes_sent;
}

void transfer_done(int source) {
  if (source >= 0) mpi().receiving[source] -= 1;
  end_pending();
}

namespace {
void on_sent(void*) { transfer_done(-1); }
void on_received(void* source) { transfer_done(int(reinterpret_cast<intptr_t>(source))); }
}  // namespace

void send_tile(starpu_data_handle_t handle, int dest, int64_t tag, bool synchronous) {
  transfer_posted(-1, int64_t(starpu_data_get_size(handle)));
  auto send = synchronous ? starpu_mpi_issend_detached : starpu_mpi_isend_detached;
  if (send(handle, dest, tag, MPI_COMM_WORLD, on_sent, nullptr) != 0) {
    transfer_done(-1);
    throw std::runtime_error("StarPU-MPI refused a send to rank " + std::to_string(dest));
  }
}

void receive_tile(starpu_data_handle_t handle, int source, int64_t tag) {
  transfer_posted(source, 0);
  void* arg = reinterpret_cast<void*>(intptr_t(source));
  if (starpu_mpi_irecv_detached(handle, source, tag, MPI_COMM_WORLD, on_received, arg) != 0) {
    transfer_done(source);
    throw std::runtime_error("StarPU-MPI refused a receive from rank " + std::to_string(source));
  }
}

std::string distributed_stall() {
  Mpi& m = mpi();
  if (!m.receiving) return "";
  std::vector<int> ranks;
  int64_t count = 0;
  for (int r = 0; r < m.size; ++r) {
    int64_t n = m.receiving[r].load();
    if (n > 0) {
      ranks.push_back(r);
      count += n;
    }
  }
  if (ranks.empty()) return "";
  return "rank " + std::to_string(m.rank) + " waits for tiles from " + rank_list(ranks) + " (" +
         std::to_string(count) + " transfers outstanding); " + blame(ranks);
}

int64_t mpi_bytes_sent() { return mpi().bytes_sent.load(); }

#else  // no StarPU-MPI in this build

bool mpi_available() { return false; }

std::string mpi_unavailable_reason() {
#if JNNTILE_STARPUMPI_FOUND
  return "this jnntile was built without MPI's headers (mpi.h), so without distributed training: install them "
         "(apt-get install libopenmpi-dev openmpi-bin) and rebuild (make build)";
#else
  return "this jnntile is built against a StarPU without StarPU-MPI, so without distributed training (`make cuda` "
         "builds StarPU without it where no MPI was installed): install Open MPI (apt-get install openmpi-bin "
         "libopenmpi-dev) and run make cuda again, or use the build on Debian's StarPU (make build, .venv)";
#endif
}

namespace {
[[noreturn]] void unavailable() { throw std::runtime_error(mpi_unavailable_reason()); }
}  // namespace

std::pair<int, int> mpi_world() { unavailable(); }
bool mpi_initialized() { return false; }
void mpi_finalize() {}
void mpi_abort(int code) { std::_Exit(code); }
int distributed_starpu_init(starpu_conf*) { unavailable(); }
void distributed_starpu_shutdown(double) { unavailable(); }
void distributed_abandon() {}
std::vector<std::string> allgather(const std::string&, const std::string&, double, bool) { unavailable(); }
void transfer_posted(int, int64_t) { unavailable(); }
void transfer_done(int) { unavailable(); }
void send_tile(starpu_data_handle_t, int, int64_t, bool) { unavailable(); }
void receive_tile(starpu_data_handle_t, int, int64_t) { unavailable(); }
std::string distributed_stall() { return ""; }
int64_t mpi_bytes_sent() { return 0; }

#endif

void install_distributed_hooks() {
  set_distributed_hooks({distributed_starpu_init, distributed_starpu_shutdown, distributed_abandon, distributed_stall});
}

}  // namespace jnntile
