// The nanobind module jnntile._xla_ffi: FFI targets for jax.ffi, the runtime
// API and the tensor registry API.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bench.h"
#include "crash.h"
#include "distributed.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"
#include "kernels/quant.h"
#include "kernels/rotary.h"
#include "ops/values.h"
#include "runtime.h"
#include "sharding.h"
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
  report_native_stack_on_crash();
  install_distributed_hooks();

  m.def("registrations", [] {
    nb::dict out;
    for (auto& [name, handler] : ffi_targets()) out[name.c_str()] = nb::capsule(handler);
    return out;
  });

  // The native enums and limits Python needs, declared once here: jnntile.tensor's dtypes, the unary functions
  // of jnntile.ops.elementwise, the head dimensions jnntile.ops.rotary accepts.
  nb::enum_<DType>(m, "DType")
      .value("float32", DType::F32)
      .value("int32", DType::I32)
      .value("int64", DType::I64)
      .value("bfloat16", DType::BF16)
      .value("uint8", DType::U8);
  nb::enum_<FloatType>(m, "FloatType").value("float32", FloatType::F32).value("bfloat16", FloatType::BF16);
  nb::enum_<Unary>(m, "Unary")
      .value("gelu_tanh", Unary::GeluTanh)
      .value("relu", Unary::Relu)
      .value("tanh", Unary::Tanh)
      .value("exp", Unary::Exp)
      .value("silu", Unary::Silu)
      .value("sigmoid", Unary::Sigmoid);
  m.attr("rotary_max_head_dim") = 2 * kRotaryMaxHalf;
  // jnntile.ops.quant: the quantizations of a frozen weight (nf4_dq: NF4 with double quantization), NF4's block
  // and the double quantization's blocks of scales (kernels/quant.h).
  nb::enum_<Quant>(m, "Quant").value("nf4", Quant::NF4).value("int8", Quant::Int8).value("nf4_dq", Quant::NF4Double);
  m.attr("nf4_block") = kNf4Block;
  m.attr("scale_block") = kScaleBlock;

  nb::enum_<Placement>(m, "Placement")
      .value("any", Placement::Any)
      .value("cpu", Placement::Cpu)
      .value("cuda", Placement::Cuda);
  nb::enum_<SwapBackend>(m, "SwapBackend")
      .value("unistd", SwapBackend::Unistd)
      .value("unistd_o_direct", SwapBackend::UnistdODirect);
  nb::class_<RuntimeConfig>(m, "RuntimeConfig")
      .def(nb::init<>())
      .def_rw("workers", &RuntimeConfig::workers)
      .def_rw("cuda_workers", &RuntimeConfig::cuda_workers)
      .def_rw("scheduler", &RuntimeConfig::scheduler)
      .def_rw("memory_limit_mb", &RuntimeConfig::memory_limit_mb)
      .def_rw("gpu_memory_limit_mb", &RuntimeConfig::gpu_memory_limit_mb)
      .def_rw("swap_dir", &RuntimeConfig::swap_dir)
      .def_rw("swap_size_mb", &RuntimeConfig::swap_size_mb)
      .def_rw("swap_backend", &RuntimeConfig::swap_backend)
      .def_rw("watchdog_s", &RuntimeConfig::watchdog_s)
      .def_rw("placement", &RuntimeConfig::placement)
      .def_rw("tf32", &RuntimeConfig::tf32)
      .def_rw("fused_attention", &RuntimeConfig::fused_attention)
      .def_rw("pin_host_memory", &RuntimeConfig::pin_host_memory)
      .def_rw("distributed", &RuntimeConfig::distributed)
      .def_rw("shard_keep_fetched", &RuntimeConfig::shard_keep_fetched);
  m.def("runtime_start", [](const RuntimeConfig& config) {
    nb::gil_scoped_release release;
    gemm_single_threaded();
    runtime_start(config);
  });
  m.def("max_cpu_workers", &max_cpu_workers);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_pipeline_depth", &cuda_pipeline_depth);
  m.def("cuda_device_free_bytes", &cuda_device_free_bytes, nb::arg("devices"));
  m.def("has_cuda", [] { return bool(JNNTILE_CUDA); });
  m.def("cuda_worker_count", [] { return runtime_running() ? int(starpu_cuda_worker_get_count()) : 0; });
  m.def("runtime_stop", [] {
    nb::gil_scoped_release release;
    runtime_stop([](bool ok) { tensor_free_all(/*sync=*/ok); });
  });
  m.def("runtime_running", &runtime_running);
  m.def("swap_failure", &swap_failure);
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
      d["cuda_tasks"] = c.cuda_tasks;
      d["cuda_seconds"] = c.cuda_seconds;
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
  nb::enum_<EmptyTasks>(m, "EmptyTasks")
      .value("round_trip", EmptyTasks::RoundTrip)
      .value("chain", EmptyTasks::Chain)
      .value("independent", EmptyTasks::Independent);
  m.def("emulated_gpu", &emulated_gpu);
  m.def("prefetch", [] { return runtime_running() && starpu_get_prefetch_flag() != 0; });
  m.def("measure_empty_tasks", [](int count, EmptyTasks kind, bool on_cuda) {
    nb::gil_scoped_release release;
    return measure_empty_tasks(count, kind, on_cuda);
  });

  m.def("tensor_create", &tensor_create);
  m.def("tensor_free", &tensor_free);
  m.def("tensor_exists", &tensor_exists);
  m.def("tensor_grad", &tensor_grad);
  m.def("tensor_compute_copy", &tensor_compute_copy);
  m.def("tensor_shard", &tensor_shard);
  m.def("tensor_shard_like", &tensor_shard_like);
  m.def("tensor_owners", &tensor_owners);
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
