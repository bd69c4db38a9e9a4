// gpucoll's gather kernel: many device arrays copied into one buffer in a single launch
// (a data-parallel bucket filled from its gradients: one launch where a copy per array
// costs a launch each, 6-7 us of host time on an H200).
//
// Compiled on first use by NVRTC through cupy.RawModule (gpucoll/_backends/nccl/kernel_loader.py).
// No headers, so that it also compiles as host C++ (the CPU test suite runs it that way).
//
//   gpucoll_gather_<W>(const unsigned long long* table, W* dst, int nparts)
//       table[k] (k < nparts): part k's address; table[nparts + k]: the byte offset in
//       dst where part k goes, table[2 * nparts] the end of the last part. Part k is
//       copied in units of W (every address, offset and length is a multiple of
//       sizeof(W)): row blockIdx.y of the grid takes parts y, y + gridDim.y, ..., and its
//       blocks copy each in a grid-stride loop over x. W: u8 u16 u32 u64 u128.

typedef unsigned char gc_u8;
typedef unsigned short gc_u16;
typedef unsigned int gc_u32;
typedef long long gc_i64;
typedef unsigned long long gc_u64;
struct __align__(16) gc_u128 { gc_u64 lo, hi; };

template <typename W>
__device__ __forceinline__ void gc_gather(const gc_u64* table, W* dst, int nparts) {
  for (gc_i64 k = blockIdx.y; k < nparts; k += gridDim.y) {
    const W* src = (const W*)table[k];
    gc_i64 start = (gc_i64)(table[nparts + k] / sizeof(W));
    gc_i64 n = (gc_i64)(table[nparts + k + 1] / sizeof(W)) - start;
    for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (gc_i64)gridDim.x * blockDim.x) {
      dst[start + i] = src[i];
    }
  }
}

extern "C" __global__ void gpucoll_gather_u8(const gc_u64* table, gc_u8* dst, int nparts) { gc_gather(table, dst, nparts); }
extern "C" __global__ void gpucoll_gather_u16(const gc_u64* table, gc_u16* dst, int nparts) { gc_gather(table, dst, nparts); }
extern "C" __global__ void gpucoll_gather_u32(const gc_u64* table, gc_u32* dst, int nparts) { gc_gather(table, dst, nparts); }
extern "C" __global__ void gpucoll_gather_u64(const gc_u64* table, gc_u64* dst, int nparts) { gc_gather(table, dst, nparts); }
extern "C" __global__ void gpucoll_gather_u128(const gc_u64* table, gc_u128* dst, int nparts) { gc_gather(table, dst, nparts); }
