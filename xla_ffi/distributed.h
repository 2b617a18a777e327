// Several processes (MPI ranks) training one model: MPI for the process,
// StarPU started through StarPU-MPI, and the few host-side exchanges every
// rank must agree on (configuration, the loss). Tiles themselves move by
// StarPU-MPI transfers submitted by ops (ops/allreduce.cc).
//
// Built only where CMake found StarPU-MPI and MPI (JNNTILE_MPI, Debian's
// StarPU); elsewhere every entry point but mpi_available() throws, saying why.
#pragma once

#include <starpu.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jnntile {

bool mpi_available();
// Why this build has no distributed training ("" when it has).
std::string mpi_unavailable_reason();

// MPI for the whole process, initialised on first call (MPI_THREAD_MULTIPLE:
// host exchanges run on the calling thread beside StarPU-MPI's progression
// thread) and finalised by mpi_finalize at exit; {rank, size}.
std::pair<int, int> mpi_world();
bool mpi_initialized();
// Skipped after a failure: StarPU-MPI's thread may still be inside MPI.
void mpi_finalize();
[[noreturn]] void mpi_abort(int code);

// Makes the runtime start and stop StarPU through the functions below when its config is distributed
// (runtime.h's DistributedHooks: the runtime, the layer below, does not call into this one). Called once at import.
void install_distributed_hooks();

// starpu_init / starpu_shutdown through StarPU-MPI. The shutdown first meets
// the other ranks in a barrier that sleeps while it waits (StarPU-MPI's own
// barrier polls) and gives up after timeout_s naming the ranks that did not come.
int distributed_starpu_init(starpu_conf* conf);
void distributed_starpu_shutdown(double timeout_s);
// After a failure: leave StarPU-MPI as it is (its thread may wait for a dead
// rank forever), and do not finalise MPI; the process is expected to exit.
void distributed_abandon();

// Every rank's `mine`, in rank order. Point-to-point messages on a
// communicator of their own, polled with sleeps (no core spins while a rank
// waits), so a rank that never comes is named: throws after timeout_s,
// saying whether it answers a ping (a heartbeat thread in every process
// answers them while the process lives). `patient`: wait on as long as the
// ranks missing answer pings (e.g. while rank 0 alone writes a checkpoint).
std::vector<std::string> allgather(const std::string& mine, const std::string& what, double timeout_s,
                                   bool patient = false);

// Transfers of tiles (ops/allreduce.cc): counted as pending work so workers
// stay awake for them and the watchdog sees them; receives by source rank so
// a stalled wait can name the ranks it waits for.
void transfer_posted(int source, int64_t bytes_sent);
void transfer_done(int source);
// A detached StarPU-MPI send of the tile to `dest` / receive into it from `source`, counted as above
// (`tag`: a starpu_mpi_tag_t, the same on both sides). Throw when StarPU-MPI refuses them. A `synchronous` send
// moves no data before the receive is posted: StarPU-MPI otherwise receives what arrives early into memory
// of its own.
void send_tile(starpu_data_handle_t handle, int dest, int64_t tag, bool synchronous = false);
// Whether a send of the tile that its receiver may post late goes synchronously: tiles above 64 KiB. A small
// tile's early copy costs the receiver next to nothing, and a synchronous send costs its handshake: the norm's
// partial sums (8 bytes a gradient tile) sent synchronously took 80 s a step on 4 ranks sharing 2 cores,
// against 13-16 s for the whole step sent eagerly (the `state` model of bench/multinode.py).
inline bool send_synchronously(starpu_data_handle_t handle) { return starpu_data_get_size(handle) > (64 << 10); }
void receive_tile(starpu_data_handle_t handle, int source, int64_t tag);
// For the watchdog's message: "" when no receive is outstanding, else which
// ranks this one waits for, and which ranks do not answer a ping (dead or
// stopped) or that all answer.
std::string distributed_stall();
int64_t mpi_bytes_sent();

}  // namespace jnntile
