// The nanobind module jnntile._xla_ffi: FFI targets for jax.ffi, the runtime
// API and the tensor registry API.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "distributed.h"
#include "kernels/gemm.h"
#include "ops/data.h"
#include "runtime.h"
#include "task.h"
#include "tensor.h"

namespace nb = nanobind;

namespace jnntile {

std::vector<std::pair<std::string, void*>>& ffi_targets() {
  static auto* targets = new std::vector<std::pair<std::string, void*>>();
  return *targets;
}

}  // namespace jnntile

NB_MODULE(_xla_ffi, m) {
  using namespace jnntile;

  m.def("registrations", [] {
    nb::dict out;
    for (auto& [name, handler] : ffi_targets()) out[name.c_str()] = nb::capsule(handler);
    return out;
  });

  m.def(
      "runtime_start",
      [](int workers, int cuda_workers, const std::string& scheduler, int64_t memory_limit_mb,
         int64_t gpu_memory_limit_mb, const std::string& swap_dir, int64_t swap_size_mb, int swap_backend,
         double watchdog_s, int placement, bool tf32, bool pin_host_memory, bool distributed) {
        RuntimeConfig config;
        config.workers = workers;
        config.cuda_workers = cuda_workers;
        config.scheduler = scheduler;
        config.memory_limit_mb = memory_limit_mb;
        config.gpu_memory_limit_mb = gpu_memory_limit_mb;
        config.swap_dir = swap_dir;
        config.swap_size_mb = swap_size_mb;
        config.swap_backend = SwapBackend(swap_backend);
        config.watchdog_s = watchdog_s;
        config.placement = Placement(placement);
        config.tf32 = tf32;
        config.pin_host_memory = pin_host_memory;
        config.distributed = distributed;
        nb::gil_scoped_release release;
        gemm_single_threaded();
        runtime_start(config);
      },
      nb::arg("workers"), nb::arg("cuda_workers"), nb::arg("scheduler"), nb::arg("memory_limit_mb"),
      nb::arg("gpu_memory_limit_mb"), nb::arg("swap_dir"), nb::arg("swap_size_mb"), nb::arg("swap_backend"),
      nb::arg("watchdog_s"), nb::arg("placement"), nb::arg("tf32"), nb::arg("pin_host_memory"), nb::arg("distributed"));
  m.def("max_cpu_workers", &max_cpu_workers);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_device_memory_bytes", &cuda_device_memory_bytes);
  m.def("cuda_device_free_bytes", &cuda_device_free_bytes);
  m.def("has_cuda", [] { return bool(JNNTILE_CUDA); });
  m.def("cuda_worker_count", [] { return runtime_running() ? int(starpu_cuda_worker_get_count()) : 0; });
  m.def("runtime_stop", [] {
    nb::gil_scoped_release release;
    runtime_stop([](bool ok) { tensor_free_all(/*sync=*/ok); });
  });
  m.def("runtime_running", &runtime_running);
  m.def("blas_core", [] { return std::string(blas_core()); });
  m.def("wait_all", [] {
    nb::gil_scoped_release release;
    require_runtime();
    wait_all("wait_all");
  });
  m.def("runtime_stats", [] {
    RuntimeStats s = runtime_stats();
    nb::dict out;
    out["tasks_submitted"] = s.tasks_submitted;
    out["tasks_completed"] = s.tasks_completed;
    out["tasks_pending"] = s.tasks_pending;
    nb::dict codelets;
    for (auto& [name, c] : s.codelets) {
      nb::dict d;
      d["tasks"] = c.tasks;
      d["seconds"] = c.seconds;
      codelets[name.c_str()] = d;
    }
    out["codelets"] = codelets;
    out["median_task_s"] = s.median_task_s;
    nb::list workers;
    for (auto& w : s.workers) {
      nb::dict d;
      d["id"] = w.id;
      d["name"] = w.name;
      d["busy_s"] = w.busy_s;
      d["tasks"] = w.tasks;
      workers.append(d);
    }
    out["workers"] = workers;
    nb::list nodes;
    for (auto& n : s.nodes) {
      nb::dict d;
      d["node"] = n.node;
      d["kind"] = n.kind;
      d["used_bytes"] = n.used_bytes;
      d["total_bytes"] = n.total_bytes;
      d["peak_used_bytes"] = n.peak_used_bytes;
      nodes.append(d);
    }
    out["nodes"] = nodes;
    out["bytes_moved"] = s.bytes_moved;
    out["tensors"] = tensor_count();
    return out;
  });

  m.def("reset_peaks", &reset_peaks);

  m.def("mpi_available", &mpi_available);
  m.def("mpi_unavailable_reason", &mpi_unavailable_reason);
  m.def("mpi_world", [] {
    nb::gil_scoped_release release;
    return mpi_world();
  });
  m.def("mpi_finalize", [] {
    nb::gil_scoped_release release;
    mpi_finalize();
  });
  m.def("mpi_abort", &mpi_abort);
  m.def("mpi_bytes_sent", &mpi_bytes_sent);
  m.def("allgather", [](nb::bytes mine, const std::string& what, double timeout_s, bool patient) {
    std::string data(mine.c_str(), mine.size());
    std::vector<std::string> all;
    {
      nb::gil_scoped_release release;
      all = allgather(data, what, timeout_s, patient);
    }
    nb::list out;
    for (const std::string& s : all) out.append(nb::bytes(s.data(), s.size()));
    return out;
  });
  m.def("measure_empty_task_latency", [](int count) {
    nb::gil_scoped_release release;
    return measure_empty_task_latency(count);
  });

  m.def("tensor_create", [](const Index& shape, const Index& tile_shape, int dtype) {
    return tensor_create(shape, tile_shape, DType(dtype));
  });
  m.def("tensor_free", &tensor_free);
  m.def("tensor_exists", &tensor_exists);
  m.def("tensor_grad", &tensor_grad);
  // Whole tensors, or the block of tiles tiles_from <= i < tiles_to (per axis)
  // when those are given: the array is then that block alone (see TileBox).
  m.def(
      "tensor_write",
      [](int64_t id, nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu> array, const Index& tiles_from,
         const Index& tiles_to) {
        void* data = const_cast<void*>(array.data());
        int64_t nbytes = int64_t(array.nbytes());
        nb::gil_scoped_release release;
        write_from_host(id, data, nbytes, TileBox{tiles_from, tiles_to});
      },
      nb::arg("id"), nb::arg("array"), nb::arg("tiles_from") = Index(), nb::arg("tiles_to") = Index());
  m.def(
      "tensor_read",
      [](int64_t id, nb::ndarray<nb::c_contig, nb::device::cpu> out, const Index& tiles_from, const Index& tiles_to) {
        void* data = out.data();
        int64_t nbytes = int64_t(out.nbytes());
        nb::gil_scoped_release release;
        read_to_host(id, data, nbytes, TileBox{tiles_from, tiles_to});
      },
      nb::arg("id"), nb::arg("out"), nb::arg("tiles_from") = Index(), nb::arg("tiles_to") = Index());
}
