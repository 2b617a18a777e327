#include "task.h"

#include <string>

namespace jnntile {

starpu_codelet make_codelet(const char* name, KernelEntry cpu, KernelEntry cuda) {
  starpu_codelet cl;
  starpu_codelet_init(&cl);
  cl.where = STARPU_CPU;
  cl.cpu_funcs[0] = cpu;
  cl.cpu_funcs_name[0] = name;
#if JNNTILE_CUDA
  if (cuda != nullptr) {
    cl.where |= STARPU_CUDA;
    cl.cuda_funcs[0] = emulated_gpu() ? cpu : cuda;  // tools/emulated_gpu: host memory, CPU kernels
    cl.cuda_flags[0] = STARPU_CUDA_ASYNC;
  }
#endif
  cl.nbuffers = STARPU_VARIABLE_NBUFFERS;
  cl.name = name;
  // Zeroed, never freed: codelets live as long as the process, and StarPU
  // initialises (and after a restart re-initialises) the model on first use.
  auto* model = new starpu_perfmodel();
  model->type = STARPU_HISTORY_BASED;
  model->symbol = (new std::string(std::string("jnntile_") + name))->c_str();
  cl.model = model;
  return cl;
}

}  // namespace jnntile
