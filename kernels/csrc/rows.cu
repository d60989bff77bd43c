// Per-row kernels around the forward: the NaN/Inf check of a batch's rows, and the two ends
// of a lane call's graph (server/lane.py).
//
// expertd_nonfinite_rows: bad[r] = row r of x, of the route weights or of the forward's
// output holds a NaN or an Inf; one launch where the same check in torch ops is nine
// (isfinite, all and the ands of three tensors).
//
// A lane call's graph (server/graphs.py, GraphBank) is four steps on one stream:
//   a copy           the block's header and the bucket's routes, from the page-locked host
//                    block into its device mirror (one DMA);
//   expertd_call_in  the routes from the mirror into the graph's route buffers, and the
//                    call's m rows of x from the caller's device memory into the graph's x;
//   the forward      as any graph of the bucket captures it;
//   expertd_call_out the m rows of the output into the caller's device memory, and each
//                    row's NaN/Inf flag into the host block.
// The block is host memory mapped into the GPU's address space (cudaHostRegisterMapped):
// the host writes the call's header and routes there, launches the graph and reads the
// flags there once the graph is done, so a call is one launch and no copy of its own. Its
// header says where this call's x comes from and where its rows go, and how many rows.
// The kernels read the header and routes from the device mirror, not from the host block:
// loads from host memory are PCIe round trips, one DMA of the same bytes is not.

#include <cuda_runtime.h>
#include <stdint.h>

#include "call_block.h"

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ bool bf16_pair_nonfinite(uint32_t w) {  // exponent bits all set
  return (w & 0x7F800000u) == 0x7F800000u || (w & 0x7F80u) == 0x7F80u;
}

__device__ __forceinline__ bool chunk_nonfinite(uint4 v) {
  return bf16_pair_nonfinite(v.x) | bf16_pair_nonfinite(v.y) | bf16_pair_nonfinite(v.z) |
         bf16_pair_nonfinite(v.w);
}

__device__ __forceinline__ bool fp32_nonfinite(float f) {
  return (__float_as_uint(f) & 0x7F800000u) == 0x7F800000u;
}

// This thread's share of a bf16 row of h values: VEC = 16-byte chunks (h % 8 == 0, the row
// 16-byte aligned), else one value at a time.
template <bool VEC>
__device__ __forceinline__ bool row_nonfinite(const uint16_t* __restrict__ row, int h) {
  bool bad = false;
  if constexpr (VEC) {
    const uint4* v = reinterpret_cast<const uint4*>(row);
    for (int c = threadIdx.x; c < h / 8; c += blockDim.x) bad |= chunk_nonfinite(v[c]);
  } else {
    for (int c = threadIdx.x; c < h; c += blockDim.x) bad |= (row[c] & 0x7F80u) == 0x7F80u;
  }
  return bad;
}

template <bool VEC>
__global__ void __launch_bounds__(kThreads)
    nonfinite_rows_kernel(const uint16_t* __restrict__ x, const float* __restrict__ w,
                          const uint16_t* __restrict__ out, uint8_t* __restrict__ bad, int h,
                          int k) {
  const long long r = blockIdx.x;
  bool b = row_nonfinite<VEC>(x + r * h, h) || row_nonfinite<VEC>(out + r * h, h);
  for (int j = threadIdx.x; j < k; j += blockDim.x) b |= fp32_nonfinite(w[r * k + j]);
  b = __syncthreads_or(b);
  if (threadIdx.x == 0) bad[r] = b;
}

// One block per row of the graph: its routes (every row: the host padded the rows past m as
// "no route"), and for r < m its x row. The header and routes come from the device mirror.
__global__ void __launch_bounds__(kThreads)
    call_in_kernel(const expertd_call_header* __restrict__ hdr, const int* __restrict__ ids_src,
                   const float* __restrict__ w_src, int* __restrict__ ids, float* __restrict__ w,
                   uint4* __restrict__ x, int k, int h) {
  const long long r = blockIdx.x;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    ids[r * k + j] = ids_src[r * k + j];
    w[r * k + j] = w_src[r * k + j];
  }
  if (r >= hdr->m) return;
  const uint4* src = reinterpret_cast<const uint4*>(hdr->x_src) + r * (h / 8);
  uint4* dst = x + r * (h / 8);
  for (int c = threadIdx.x; c < h / 8; c += blockDim.x) dst[c] = __ldcg(src + c);
}

// One block per row r < m: the row out to the caller, and its flag (its x, weights or
// output non-finite) into the host block (a store the GPU posts and does not wait for).
__global__ void __launch_bounds__(kThreads)
    call_out_kernel(const expertd_call_header* __restrict__ hdr, const uint4* __restrict__ x,
                    const float* __restrict__ w, const uint4* __restrict__ out,
                    uint8_t* __restrict__ flags, int k, int h) {
  const long long r = blockIdx.x;
  if (r >= hdr->m) return;
  uint4* dst = reinterpret_cast<uint4*>(hdr->out_dst) + r * (h / 8);
  const uint4* src = out + r * (h / 8);
  const uint4* xr = x + r * (h / 8);
  bool b = false;
  for (int c = threadIdx.x; c < h / 8; c += blockDim.x) {
    const uint4 v = src[c];
    dst[c] = v;
    b |= chunk_nonfinite(v) | chunk_nonfinite(xr[c]);
  }
  for (int j = threadIdx.x; j < k; j += blockDim.x) b |= fp32_nonfinite(w[r * k + j]);
  b = __syncthreads_or(b);
  if (threadIdx.x == 0) flags[r] = b;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int launched() { return (int)cudaGetLastError(); }

}  // namespace

extern "C" {

// bad[r] <- row r of x [m, h] (bf16), w [m, k] (fp32) or out [m, h] (bf16) holds NaN/Inf, on
// `stream`. -> 0, or the CUDA error of the launch.
int expertd_nonfinite_rows(const void* x, const float* w, const void* out, uint8_t* bad,
                           long long m, int h, int k, void* stream) {
  if (m <= 0) return 0;
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* os = static_cast<const uint16_t*>(out);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (h % 8 == 0 && aligned16(x) && aligned16(out)) {
    nonfinite_rows_kernel<true><<<(unsigned)m, kThreads, 0, s>>>(xs, w, os, bad, h, k);
  } else {
    nonfinite_rows_kernel<false><<<(unsigned)m, kThreads, 0, s>>>(xs, w, os, bad, h, k);
  }
  return launched();
}

// A lane call's first step for a graph of `rows` tokens x top_k `k` over hidden size h (a
// multiple of 8; every address 16-byte aligned): see the file's head. `mirror` is the
// device copy of the block's header and the bucket's routes (call_block.h).
int expertd_call_in(const void* mirror, int* ids, float* w, void* x, int rows, int k, int h,
                    void* stream) {
  if (rows <= 0 || k <= 0 || h % 8) return (int)cudaErrorInvalidValue;
  const auto* hdr = static_cast<const expertd_call_header*>(mirror);
  const int* ids_src = reinterpret_cast<const int*>(hdr + 1);
  const float* w_src = reinterpret_cast<const float*>(ids_src + (long long)rows * k);
  call_in_kernel<<<rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      hdr, ids_src, w_src, ids, w, static_cast<uint4*>(x), k, h);
  return launched();
}

// A lane call's last step (see the file's head): the header from the mirror, the flags to
// `flags` (the host block's, at its device address); x, w and out are the graph's buffers.
int expertd_call_out(const void* mirror, uint8_t* flags, const void* x, const float* w,
                     const void* out, int rows, int k, int h, void* stream) {
  if (rows <= 0 || k <= 0 || h % 8) return (int)cudaErrorInvalidValue;
  call_out_kernel<<<rows, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const expertd_call_header*>(mirror), static_cast<const uint4*>(x), w,
      static_cast<const uint4*>(out), flags, k, h);
  return launched();
}

}  // extern "C"
