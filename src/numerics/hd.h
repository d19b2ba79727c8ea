// QATTN_HD marks a function usable from host and device code (inline on the host
// compiler, __host__ __device__ __forceinline__ under nvcc).
#pragma once

#if defined(__CUDACC__)
#define QATTN_HD __host__ __device__ __forceinline__
#else
#define QATTN_HD inline
#endif
