// What the CPU and the CUDA kernels share.
//
// Each op family has one header, kernels/<family>.h, holding the arithmetic of
// one element, one row or one reduction step as JNNTILE_HD functions (host and
// device code), and the entry points of the family as function templates over
// Device. kernels/cpu/<family>.cc defines the Device::Cpu instances (loops on
// the host), kernels/cuda/<family>.cu the Device::Cuda ones (launch code on
// StarPU's stream of the calling CUDA worker). The CPU tests thus run the same
// arithmetic the GPU runs. No CUDA type appears in these headers, so the C++
// files that include them build without the CUDA toolkit.
#pragma once
#include <cstdint>

// 1 where StarPU has CUDA and the CUDA kernels are built (CMakeLists.txt).
#ifndef JNNTILE_CUDA
#define JNNTILE_CUDA 0
#endif

#if defined(__CUDACC__)
#define JNNTILE_HD __host__ __device__ inline
#else
#define JNNTILE_HD inline
#endif

namespace jnntile {

enum class Device { Cpu, Cuda };

}  // namespace jnntile
