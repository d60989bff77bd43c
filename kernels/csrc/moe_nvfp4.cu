// expertd: one shard's NVFP4 W4A16 MoE forward on Hopper (sm_90a), as a C-ABI library.
//
// What it computes (docs/protocol.md), for every route (t, j) whose expert e is owned here:
//     h = W13[e] @ x[t];  a = silu(h[:I]) * h[I:];  z = (W2[e] @ a) * (1 + w_norm)
//     out[t] = sum_j topk_weights[t, j] * z / sqrt(mean(z^2) + 1e-8)
// A layer without a post-expert norm (rms_norm = 0, w_norm = 0) gets out[t] = sum_j w_j * z.
// x and out are bf16 [M, H]; every element of out is written (zeros for a token with no owned
// route). Weights are NVFP4: E2M1 codes, an fp8 e4m3 scale per 16 k, and an fp32
// weight_scale_2 per projection (gate and up may differ); accumulation is fp32, the
// intermediates (act, z) bf16.
//
// Launches on the caller's stream, chained with programmatic dependent launch; no host sync and
// no allocation (graph-capturable; the caller's workspace, expertd_workspace_bytes):
//   1. routing           local routes grouped by expert, each expert's run padded to whole tiles
//                        of BT positions: pos_of_route, sorted_route, tile_expert, num_tiles.
//                        route_kernel (one block), route_count + route_scatter from
//                        kRouteMultiMinRoutes routes, or none: small calls are routed by GEMM1's
//                        blocks themselves (moe_gemm_self_kernel).
//   2. GEMM1 (gate/up)   per (n-block, tile): act[pos, :] = silu(gate) * up, bf16 (the 2I
//                        gate/up outputs are never stored).
//   3. GEMM2 (down)      per (n-block, tile): z[pos, :] = (W2 a) * gs * (1 + w_norm), bf16, and the
//                        block's partial sum of z^2 per position (deterministic, no atomics).
//   4. finalize_kernel   per token: coef_j = w_j / rms_j, out = sum_j coef_j * z[pos_j].
// The results do not depend on timing or on the grid a call runs on: every sum has a fixed order.
//
// GEMM formulation ("swap A/B"): weights are the MMA's A operand (M side, 16 rows per m-tile),
// tokens the B operand (N side), so a handful of tokens wastes little. Two GEMM paths:
//   v6  mma.sync.m16n8k16 bf16 -> fp32 (BT 8: decode), split-K over the warps of a block;
//   v8  wgmma m64nNk16 (BT 16 to 160), N = the tile's routes rounded up, whole K per warp.
// One k-step (16 k) is exactly one NVFP4 scale block; the weights are dequantized in registers
// (e2m1x8_to_bf16x8 and one bf16 multiply by the scale) just before the MMA.
//
// Resident weight layout (made by kernels/repack.py, checked on the CPU by tests):
//   codes  uint4 [El][Mt][K/64][32 lanes]: the 16 bytes lane (g = lane/4, t = lane%4) of a warp
//          needs for 4 k-steps of one m-tile (16 rows x 64 k). Word ks holds the 8 E2M1 codes of
//          the lane's A fragment for k-step ks (rows g, g+8 x k 2t, 2t+1, 2t+8, 2t+9), with the
//          sign and magnitude bits placed so e2m1x8_to_bf16x8 needs 8 ops for 4 registers.
//   scales bf16 [El][Mt][K/64][8 g][4 ks][2]: fp8 scale * 2^119 (exact) of rows g and g+8 for
//          k-step ks; one 32-bit word per k-step (HMUL2 broadcasts each half in its operand).
//          bf16 costs 11% more bytes per expert than fp8 but saves 7 conversion ops per k-step in
//          a kernel that is issue-bound. The product (E2M1 * 2^-126) * (fp8 * 2^119) = E2M1 * fp8 *
//          2^-7 is exact in bf16; the epilogue multiplies by weight_scale_2 * 2^7 in fp32.
//   GEMM1 rows are interleaved: m-tile m holds gate rows 8m..8m+7 then up rows 8m..8m+7, so the
//          accumulator of one thread holds gate and up of the same column (c0/c2, c1/c3).
//   w13_gscale fp32 [El][2] (gate, up), w2_gscale fp32 [El], norm_weight bf16 [H].
//
// Configurations (the list and the measurements behind each: "compiled configurations" below):
//   BT (tokens per tile; routes per expert are padded to it) = expertd_pick_bt(M, top_k, E, H, I)
//   from lambda = M top_k / E and whether H and I are multiples of 512, or the caller's bt. BT 8
//   runs v6 in one of four configurations by the call's routes (and whether H and I are multiples
//   of 512), on a grid form also chosen by its routes (launch_v6: capped grids looping over tiles
//   to 64 routes, one tile per block above);
//   BT 16, 32, 48, 64, 96, 128, 144 and 160 run v8, one configuration each. Only the kernel
//   instances those choices can reach are compiled.
//
// Work partitioning of one v6 GEMM block (NW x NK warps, all BT tokens of one tile):
//
//        k ->  [ stage 0: kg 0 | kg 1 | .. ][ stage 1 ] ...  (BK = 64*KG, ST-deep cp.async ring)
//   rows  warp (0, wk): m-tiles 0..WM-1,  k-groups kg = wk, wk + NK, ...  x BT tokens
//         warp (1, wk): m-tiles WM..2WM-1                                 (B: ldmatrix from an
//         ...                                                             XOR-swizzled tile)
//   the NK k-warps of a row slice add their partial sums through shared memory at the end.
// Weights stream through shared memory in consumption order (16-byte copies, coalesced).

#include <cuda_runtime.h>
#include <stdint.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>

#include <mutex>
#include <type_traits>

#include "wgmma.cuh"

namespace {

constexpr float kRmsEps = 1e-8f;
constexpr float kScaleShift = 128.0f;  // 2^7: undoes the 2^-7 left in the dequantized bf16

// ------------------------------------ PTX helpers --------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (padding rows).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1,
                                            uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// a * (the low / high bf16 of s2 in both halves). bf16 arithmetic keeps subnormals (no .ftz form
// exists for bf16), so E2M1 0.5 survives. The broadcast costs no instruction: ptxas folds
// it into HMUL2's operand selector (R.H0_H0 / R.H1_H1), where a prmt before the multiply would
// cost one instruction per scale (2 of ~27 per k-step).
__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t a, uint32_t s2) {
  uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n .reg .b32 b;\n mov.b32 {lo, hi}, %2;\n mov.b32 b, {lo, lo};\n"
      " mul.rn.bf16x2 %0, %1, b;\n}\n"
      : "=r"(d)
      : "r"(a), "r"(s2));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t a, uint32_t s2) {
  uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n .reg .b32 b;\n mov.b32 {lo, hi}, %2;\n mov.b32 b, {hi, hi};\n"
      " mul.rn.bf16x2 %0, %1, b;\n}\n"
      : "=r"(d)
      : "r"(a), "r"(s2));
  return d;
}

// E2M1 -> bf16 by moving bits: a code's sign goes to bf16 bit 15 and its 3 magnitude bits to
// bits 6-8 (exponent LSBs + mantissa MSB), which yields value * 2^-126 exactly (0.5 becomes a bf16
// subnormal). The repack (repack.py: e2m1_regs, the same operations in Python, and the bit
// positions derived from them) stores the 8 codes of one k-step so that 4 registers take 8 ops,
// the fewest an exhaustive search over masks, shifts, rotations, byte permutes and carry-free
// multiplies found (10 with two-copy multiplies; docs/kernel.md): the plain
// mask, two rotations and a mask each, and one masked word times 2^2 + 2^7 + 2^12 (the three
// shifted copies never overlap, so the product is their OR), then a mask:
//   reg | ops                       | code bits from q
//    0  | and                       | 6 7 8 15 22 23 24 31
//    1  | rot 10, and               | 5 12 13 14 21 28 29 30
//    2  | rot 13, and               | 2 9 10 11 18 25 26 27
//    3  | and, x * 4228, and        | 0 1 3 4 16 17 19 20
__device__ __forceinline__ void e2m1x8_to_bf16x8(uint32_t q, uint32_t (&r)[4]) {
  r[0] = q & 0x81C081C0u;
  r[1] = __funnelshift_l(q, q, 10) & 0x81C081C0u;
  r[2] = __funnelshift_l(q, q, 13) & 0x81C081C0u;
  r[3] = ((q & 0x001B001Bu) * 4228u) & 0x81C081C0u;
}

// Programmatic dependent launch (sm_90): a kernel launched with the PDL attribute may start while
// its predecessor runs; it must wait (griddepcontrol.wait = predecessor complete and its writes
// visible) before reading what the predecessor wrote. launch_dependents lets the next kernel's
// blocks be scheduled once every block of this grid has issued it or exited.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ uint16_t to_bf16_bits(float v) {
  return static_cast<uint16_t>(pack_bf16x2(v, 0.0f) & 0xFFFFu);
}
__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

// ------------------------------------ 1. routing ---------------------------------------------

// route_kernel: one block (1024 threads, or 256 for calls of <= kRouteSmallMaxRoutes routes: fewer
// warps at each barrier). Shared memory: cnt[El], off[El + 1], fill[El]. An expert's routes fill
// its tiles in order (full tiles, then the rest), so a tile's valid routes are a prefix of its
// positions (the v8 GEMMs size their MMAs by it). Filling every tile of an expert about equally
// instead measured 1.00-1.04x the time (M = 16-16384, H200): the wider MMAs of full tiles win.
// The local expert of a thread's first kCached routes stays in registers between the count and
// the scatter (one round of dependent global loads instead of two).
constexpr int kRouteThreads = 1024;
constexpr int kCached = 4;

// first >= 0: the shard owns ids first .. first + el - 1 (the host checked first + el <= E), and
// the local expert is id - first, with no dependent load of the local_of table.
__device__ __forceinline__ int local_expert(const int* __restrict__ topk_ids,
                                            const int* __restrict__ local_of, int first, int r,
                                            int num_experts, int el) {
  const int id = topk_ids[r];
  const int e = first >= 0 ? id - first : (id >= 0 && id < num_experts) ? local_of[id] : -1;
  return (e >= 0 && e < el) ? e : -1;
}

// Warp 0 of a routing block: exclusive scan of the counts padded to whole tiles (lane l owns
// experts [l c, (l + 1) c)): off[e] for every expert and the total in off[el]; returns the
// lane's inclusive sum (lane 31's is the total).
__device__ __forceinline__ int scan_padded_counts(const int* cnt, int* off, int el, int bt,
                                                  int lane) {
  const int c = (el + 31) / 32;
  int sum = 0;
  for (int e = lane * c; e < min(el, (lane + 1) * c); ++e) sum += (cnt[e] + bt - 1) / bt * bt;
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  int acc = incl - sum;
  for (int e = lane * c; e < min(el, (lane + 1) * c); ++e) {
    off[e] = acc;
    acc += (cnt[e] + bt - 1) / bt * bt;
  }
  if (lane == 31) off[el] = incl;
  return incl;
}

// The expert of a tile: the last e with off[e] <= tile * bt (empty experts share offsets).
__device__ __forceinline__ int expert_of_tile(const int* off, int el, int tile, int bt) {
  int lo = 0, hi = el - 1;
  const int p = tile * bt;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= p) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// warp_tables (shards of <= 32 local experts): after the count every warp scans the padded
// counts itself in registers (lane e: expert e), warp 0 writes num_tiles, tile_expert and the
// padding's -1 (positions past each expert's routes), and every thread places its routes; no
// barrier after the count. Larger shards take warp 0's scan and a padding pass, each behind a
// barrier (~0.7-0.9 us apiece at any call size on the H200). Both give the same tables.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) route_kernel(
    const int* __restrict__ topk_ids, int num_routes, const int* __restrict__ local_of, int first,
    int num_experts, int el, int bt, int* __restrict__ sorted_route,
    int* __restrict__ pos_of_route, int* __restrict__ tile_expert, int* __restrict__ num_tiles,
    int warp_tables) {
  extern __shared__ int sm[];
  int* cnt = sm;
  int* off = sm + el;
  int* fill = off + el + 1;
  const int tid = threadIdx.x;
  pdl_wait();  // the previous forward's finalize may still read pos_of_route
  pdl_launch_dependents();
  for (int i = tid; i < el; i += THREADS) {
    cnt[i] = 0;
    fill[i] = 0;
  }
  int cached[kCached];
#pragma unroll
  for (int i = 0; i < kCached; ++i) {
    const int r = tid + i * THREADS;
    cached[i] = r < num_routes ? local_expert(topk_ids, local_of, first, r, num_experts, el) : -1;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kCached; ++i)
    if (cached[i] >= 0) atomicAdd(&cnt[cached[i]], 1);
  for (int r = tid + kCached * THREADS; r < num_routes; r += THREADS) {
    const int e = local_expert(topk_ids, local_of, first, r, num_experts, el);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  if (warp_tables) {
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = tid & 31;
    const int c = lane < el ? cnt[lane] : 0;
    const int padded = (c + bt - 1) / bt * bt;
    int incl = padded;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kAll, incl, o);
      if (lane >= o) incl += v;
    }
    const int off_l = incl - padded;  // expert lane's first position
    if (tid < 32) {
      if (lane == 31) *num_tiles = incl / bt;
      for (int t = off_l / bt; t < incl / bt; ++t) tile_expert[t] = lane;
      for (int p = off_l + c; p < incl; ++p) sorted_route[p] = -1;
    }
    // Route r (expert e, -1: not local) at its expert's first position (lane e's off_l) plus
    // its place among the expert's routes; every lane of the warp calls it (the shuffle).
    auto place = [&](const int r, const int e) {
      const int oe = __shfl_sync(kAll, off_l, e & 31);
      if (r < num_routes) {
        const int p = e >= 0 ? oe + atomicAdd(&fill[e], 1) : -1;
        if (e >= 0) sorted_route[p] = r;
        pos_of_route[r] = p;
      }
    };
#pragma unroll
    for (int i = 0; i < kCached; ++i) place(tid + i * THREADS, cached[i]);
    // routes past the cached ones: warp-uniform trip count (the shuffle needs every lane)
    for (int r0 = kCached * THREADS + (tid - lane); r0 < num_routes; r0 += THREADS) {
      const int r = r0 + lane;
      place(r, r < num_routes ? local_expert(topk_ids, local_of, first, r, num_experts, el) : -1);
    }
    return;
  }
  if (tid < 32) {
    const int total = scan_padded_counts(cnt, off, el, bt, tid);
    if (tid == 31) *num_tiles = total / bt;
  }
  __syncthreads();
  const int total = off[el];
  for (int p = tid; p < total; p += THREADS) sorted_route[p] = -1;
  for (int tile = tid; tile < total / bt; tile += THREADS)
    tile_expert[tile] = expert_of_tile(off, el, tile, bt);
  __syncthreads();  // padding written before the scatter overwrites the used positions
#pragma unroll
  for (int i = 0; i < kCached; ++i) {
    const int r = tid + i * THREADS;
    if (r < num_routes) {
      int p = -1;
      if (cached[i] >= 0) {
        p = off[cached[i]] + atomicAdd(&fill[cached[i]], 1);
        sorted_route[p] = r;
      }
      pos_of_route[r] = p;
    }
  }
  for (int r = tid + kCached * THREADS; r < num_routes; r += THREADS) {
    const int e = local_expert(topk_ids, local_of, first, r, num_experts, el);
    int p = -1;
    if (e >= 0) {
      p = off[e] + atomicAdd(&fill[e], 1);
      sorted_route[p] = r;
    }
    pos_of_route[r] = p;
  }
}

// Calls of kRouteMultiMinRoutes routes and more: the same routing as route_kernel in two kernels
// over chunks of kRouteChunk routes (one block each), because one block streams topk_ids at one
// SM's rate (17 us at M = 4096, 60 at 16384 on the H200, with GEMM1 waiting on it).
//   route_count_kernel    block b: its chunk's local experts parked in pos_of_route[r] (-1: not
//                         local; one round of the two dependent loads per route), the chunk's
//                         count per expert into hist[b][El].
//   route_scatter_kernel  block b: every block's counts from hist (El x blocks ints), so each
//                         block knows the padded offsets (warp 0's scan, as route_kernel), the
//                         tile count and its own start inside each expert's run (the counts of
//                         blocks before it); then its chunk's routes to their positions (in
//                         order within the block by a shared-memory atomic: an expert's routes are
//                         block-major, unlike route_kernel's order, but every route's output
//                         depends on its own row only: the same bits). tile_expert, the padding's
//                         -1 and num_tiles are split over the blocks.
constexpr int kRouteChunk = 4096;  // routes per block (4 per thread)

__global__ void __launch_bounds__(kRouteThreads) route_count_kernel(
    const int* __restrict__ topk_ids, int num_routes, const int* __restrict__ local_of, int first,
    int num_experts, int el, int* __restrict__ pos_of_route, int* __restrict__ hist) {
  extern __shared__ int cnt[];
  const int tid = threadIdx.x;
  pdl_wait();  // the previous forward's finalize may still read pos_of_route
  pdl_launch_dependents();
  for (int i = tid; i < el; i += kRouteThreads) cnt[i] = 0;
  __syncthreads();
  const int r0 = blockIdx.x * kRouteChunk;
  const int r1 = min(num_routes, r0 + kRouteChunk);
  for (int r = r0 + tid; r < r1; r += kRouteThreads) {
    const int e = local_expert(topk_ids, local_of, first, r, num_experts, el);
    pos_of_route[r] = e;  // parked for route_scatter_kernel
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  for (int i = tid; i < el; i += kRouteThreads)
    hist[static_cast<long long>(blockIdx.x) * el + i] = cnt[i];
}

__global__ void __launch_bounds__(kRouteThreads) route_scatter_kernel(
    int num_routes, int el, int bt, const int* __restrict__ hist, int* __restrict__ sorted_route,
    int* __restrict__ pos_of_route, int* __restrict__ tile_expert, int* __restrict__ num_tiles) {
  extern __shared__ int sm[];
  int* cnt = sm;            // [El] the call's count per expert
  int* off = sm + el;       // [El + 1] padded offsets
  int* start = off + el + 1;  // [El] this block's first slot inside each expert's run
  int* fill = start + el;   // [El]
  const int tid = threadIdx.x, b = blockIdx.x, blocks = gridDim.x;
  pdl_wait();  // route_count_kernel's counts and parked experts
  pdl_launch_dependents();
  for (int e = tid; e < el; e += kRouteThreads) {
    int total = 0, before = 0;
    for (int q = 0; q < blocks; ++q) {
      const int v = hist[static_cast<long long>(q) * el + e];
      if (q < b) before += v;
      total += v;
    }
    cnt[e] = total;
    start[e] = before;
    fill[e] = 0;
  }
  __syncthreads();
  if (tid < 32) {
    const int total = scan_padded_counts(cnt, off, el, bt, tid);
    if (tid == 31 && b == 0) *num_tiles = total / bt;
  }
  __syncthreads();
  // The padding of expert e (slots off[e] + cnt[e] .. off[e + 1] - 1) by block e % blocks, and
  // the tiles' experts split over the blocks.
  for (int e = b; e < el; e += blocks)
    for (int p = off[e] + cnt[e] + tid; p < off[e + 1]; p += kRouteThreads) sorted_route[p] = -1;
  const int tiles = off[el] / bt;
  for (int tile = b * kRouteThreads + tid; tile < tiles; tile += blocks * kRouteThreads)
    tile_expert[tile] = expert_of_tile(off, el, tile, bt);
  const int r0 = b * kRouteChunk;
  const int r1 = min(num_routes, r0 + kRouteChunk);
  for (int r = r0 + tid; r < r1; r += kRouteThreads) {
    const int e = pos_of_route[r];  // parked by route_count_kernel
    int p = -1;
    if (e >= 0) {
      p = off[e] + start[e] + atomicAdd(&fill[e], 1);
      sorted_route[p] = r;
    }
    pos_of_route[r] = p;
  }
}

// ------------------------------------ 2./3. grouped GEMM -------------------------------------

struct GemmArgs {
  const uint4* codes;          // [El][Mt][K/64][32] 16-byte lane chunks
  const uint4* scales;         // [El][Mt][K/64][64 B] as 4 uint4
  const uint16_t* act_in;      // GEMM1: x [M, K]; GEMM2: act [pcap, K] (bf16 bits)
  const int* sorted_route;     // [pcap]
  const int* tile_expert;      // [t_max]
  const int* num_tiles;        // [1]
  const float* gscale;         // GEMM1: [El][2] (gate, up); GEMM2: [El]
  const uint16_t* norm_weight;  // GEMM2: bf16 [H]
  uint16_t* out;               // GEMM1: act [pcap, N/2]; GEMM2: z [pcap, N] (bf16 bits)
  float* partial;              // GEMM2: [N / rows per block][pcap] sum of z^2
  int k;                       // reduction length (H for GEMM1, I for GEMM2)
  int mt;                      // m-tiles per expert (N / 16)
  int top_k;
  int pcap;
};

template <int BT, int WM, int NW, int NK, int KG, int ST>
struct GemmShape {
  static constexpr int kWarps = NW * NK;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBK = 64 * KG;
  static constexpr int kMTiles = NW * WM;                 // m-tiles per block
  static constexpr int kWBytes = kMTiles * KG * 512;      // codes per stage
  static constexpr int kSBytes = kMTiles * KG * 128;      // scales per stage (bf16)
  static constexpr int kABytes = BT * kBK * 2;            // activations per stage
  static constexpr int kStageBytes = kWBytes + kSBytes + kABytes;
  static constexpr int kRedBytes = (NK - 1) * NW * WM * (BT / 8) * 4 * 32 * 4;
  static constexpr int kSmemBytes = kStageBytes * ST;
  static constexpr int kWChunks = kWBytes / 16, kSChunks = kSBytes / 16, kAChunks = kABytes / 16;
  static constexpr int kWPer = (kWChunks + kThreads - 1) / kThreads;  // 16-B copies per thread
  static constexpr int kSPer = (kSChunks + kThreads - 1) / kThreads;
  static constexpr int kAPer = (kAChunks + kThreads - 1) / kThreads;
  static_assert(BT % 8 == 0, "BT is a multiple of the MMA's n = 8");
  static_assert(kBK >= 64, "the activation swizzle needs 8 chunks per row");
  static_assert(KG % NK == 0, "each k-warp takes KG / NK groups of every stage");
  static_assert(kRedBytes <= kSmemBytes, "the split-K reduction reuses the pipeline memory");
};

// Epilogue of one work item, shared by the mma.sync (v6) and wgmma (v8) GEMMs. acc[w][n][c]
// is the accumulator of m-tile (mt0 + wm * WM + w), n-tile n, in the m16n8 fragment layout
// (c0/c1 row g, c2/c3 row g + 8, columns 2 t4 and 2 t4 + 1), which wgmma's m64nN accumulator
// repeats per 8 columns. `active`: this warp holds the item's final sums (split-K: k-warp 0).
// GATED: act[pos, col] = silu(gate) * up (rows g / g + 8 are gate / up of column col).
// Down: z[pos, row] = acc * gs * (1 + w_norm), and the block's sum of z^2 per position into
// partial[xb][pos], summed over the NW row warps in a fixed order (deterministic). Every thread
// of the block must call it (the down projection's barrier).
template <int BT, int WM, int NW, bool GATED>
__device__ __forceinline__ void gemm_epilogue(const GemmArgs& a, const float (&acc)[WM][BT / 8][4],
                                              const int e, const int tile, const int xb,
                                              const int mt0, const int wm, const bool active,
                                              float (&red)[NW][BT]) {
  constexpr int NT = BT / 8;
  const int tid = threadIdx.x, T = blockDim.x;
  const int lane = tid & 31, g = lane >> 2;
  const int t4 = lane & 3;
  if constexpr (GATED) {
    if (!active) return;  // no barrier follows
    const float gs_gate = a.gscale[2 * e] * kScaleShift;
    const float gs_up = a.gscale[2 * e + 1] * kScaleShift;
    const int n_out = a.mt * 8;  // I
#pragma unroll
    for (int w = 0; w < WM; ++w) {
      const int col = (mt0 + wm * WM + w) * 8 + g;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const long long pos = static_cast<long long>(tile) * BT + n * 8 + 2 * t4;
        const float v0 = silu(acc[w][n][0] * gs_gate) * (acc[w][n][2] * gs_up);
        const float v1 = silu(acc[w][n][1] * gs_gate) * (acc[w][n][3] * gs_up);
        a.out[pos * n_out + col] = to_bf16_bits(v0);
        a.out[(pos + 1) * n_out + col] = to_bf16_bits(v1);
      }
    }
  } else {
    if (active) {
      const float gs = a.gscale[e] * kScaleShift;
      const int n_out = a.mt * 16;  // H
      float ss[NT][2];
#pragma unroll
      for (int n = 0; n < NT; ++n) ss[n][0] = ss[n][1] = 0.0f;
#pragma unroll
      for (int w = 0; w < WM; ++w) {
        const int row = (mt0 + wm * WM + w) * 16 + g;
        const float f_lo = gs * (1.0f + bf16_bits_to_float(a.norm_weight[row]));
        const float f_hi = gs * (1.0f + bf16_bits_to_float(a.norm_weight[row + 8]));
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const long long pos = static_cast<long long>(tile) * BT + n * 8 + 2 * t4;
          const float z0 = acc[w][n][0] * f_lo, z1 = acc[w][n][1] * f_lo;
          const float z2 = acc[w][n][2] * f_hi, z3 = acc[w][n][3] * f_hi;
          a.out[pos * n_out + row] = to_bf16_bits(z0);
          a.out[(pos + 1) * n_out + row] = to_bf16_bits(z1);
          a.out[pos * n_out + row + 8] = to_bf16_bits(z2);
          a.out[(pos + 1) * n_out + row + 8] = to_bf16_bits(z3);
          ss[n][0] += z0 * z0 + z2 * z2;
          ss[n][1] += z1 * z1 + z3 * z3;
        }
      }
      // Sum over the 8 row groups g (lanes with equal t4), then over warps in a fixed order.
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float v = ss[n][c];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (g == 0) red[wm][n * 8 + 2 * t4 + c] = v;
        }
    }
    __syncthreads();
    for (int i = tid; i < BT; i += T) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) v += red[w][i];
      a.partial[static_cast<long long>(xb) * a.pcap + tile * BT + i] = v;
    }
  }
}

// This lane's ldmatrix.x4 byte offset in a swizzled token tile for k-steps 0, 1 of k-group 0 and
// n-tile 0: lane l reads row l % 8, chunk l / 8 (matrices 0-3 = k 0-7, 8-15 of k-step 0, then of
// k-step 1). Rows are multiples of 128 bytes long, so the chunk's bit 2 is the offset's bit 6
// (flipped for k-steps 2, 3).
__device__ __forceinline__ uint32_t b_lane_off(const int row_chunks, const int lane) {
  const int row = lane & 7;
  return (row * row_chunks + (((lane >> 3) ^ row) & 7)) * 16;
}

// One k-group (4 k-steps) of one warp (v6's gemm_tile): dequantize the A fragments of
// its WM m-tiles (codes q, bf16 scales sc: the lane's 16 bytes of each) and multiply them by the
// NT token n-tiles, read with ldmatrix from a swizzled tile in shared memory at a_s: token row r
// holds row_chunks 16-byte chunks, chunk kg * 8 + c stored at kg * 8 + (c ^ r % 8). b_off: this
// lane's offset for k-group 0, n-tile 0 (b_lane_off); n-tile n is 8 rows further.
template <int WM, int NT>
__device__ __forceinline__ void kgroup_mma(float (&acc)[WM][NT][4], const uint4 (&q)[WM],
                                           const uint4 (&sc)[WM], const uint32_t a_s,
                                           const uint32_t b_off, const int kg,
                                           const int row_chunks) {
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    // Dequantize this warp's A fragments for k-steps 2p, 2p+1 (8 registers per m-tile).
    uint32_t af[WM][2][4];
#pragma unroll
    for (int w = 0; w < WM; ++w) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t word = p == 0 ? (h == 0 ? q[w].x : q[w].y) : (h == 0 ? q[w].z : q[w].w);
        // bf16 scales * 2^119 of rows g (low half) and g+8 (high half) for this k-step
        const uint32_t s2 = p == 0 ? (h == 0 ? sc[w].x : sc[w].y) : (h == 0 ? sc[w].z : sc[w].w);
        uint32_t r[4];
        e2m1x8_to_bf16x8(word, r);
        af[w][h][0] = bf16x2_mul_lo(r[0], s2);  // row g:   the low scale
        af[w][h][1] = bf16x2_mul_hi(r[1], s2);  // row g+8: the high one
        af[w][h][2] = bf16x2_mul_lo(r[2], s2);
        af[w][h][3] = bf16x2_mul_hi(r[3], s2);
      }
    }
    // k-steps 2p, 2p + 1 are chunks 4p.. 4p + 3 of the k-group: the swizzle flips bit 2
    const uint32_t b_p = a_s + (b_off ^ (p * 64)) + kg * 128;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(b_p + n * 8 * row_chunks * 16, b0, b1, b2, b3);
#pragma unroll
      for (int w = 0; w < WM; ++w) {
        mma_bf16(acc[w][n], af[w][0], b0, b1);
        mma_bf16(acc[w][n], af[w][1], b2, b3);
      }
    }
  }
}

// Split-K inside a block: k-warps 1..NK-1 hand their partial sums to k-warp 0 through shared
// memory (rbuf: (NK - 1) NW WM NT 4 32 floats, free when called); summed in a fixed order, so
// results do not depend on timing. Every thread of the block calls it (one barrier inside).
template <int WM, int NT, int NW, int NK>
__device__ __forceinline__ void splitk_reduce(float (&acc)[WM][NT][4], float* rbuf, const int wm,
                                              const int wk, const int lane) {
  constexpr int kPerWarp = WM * NT * 4;
  if (wk > 0) {
#pragma unroll
    for (int w = 0; w < WM; ++w)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          rbuf[(((wk - 1) * NW + wm) * kPerWarp + (w * NT + n) * 4 + c) * 32 + lane] =
              acc[w][n][c];
  }
  __syncthreads();
  if (wk == 0) {
#pragma unroll
    for (int j = 0; j < NK - 1; ++j)
#pragma unroll
      for (int w = 0; w < WM; ++w)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[w][n][c] += rbuf[((j * NW + wm) * kPerWarp + (w * NT + n) * 4 + c) * 32 + lane];
  }
}

// One block = NW x NK warps: warp (wm, wk) owns m-tiles wm*WM.. and k-groups kg = wk, wk+NK, ...
// of every stage (split-K inside the block: more warps per SM for the same bytes in flight);
// the NK partial accumulators are summed through shared memory at the end in a fixed order.
// gemm_tile computes one work item: tile `tile` (BT positions of one expert) x n-block `xb`
// (kMTiles m-tiles), and issues launch_dependents after its main loop. Called once per block by
// moe_gemm_kernel (grid = n-blocks x tiles) and in a loop over tiles by moe_gemm_loop_kernel.
// Returns with the block's shared memory still in use by the epilogue of some warps: the
// caller's __syncthreads separates two items.
// SELF: the call's routing comes from the caller's shared memory (self_tile_e[tile], self_sorted
// by position: moe_gemm_self_kernel) instead of route_kernel's tables in global memory.
// EARLY: weights and scales issued as soon as the expert is known, before the token rows'
// indices (a dependent global load and a barrier), joining stage 0's commit group: 1 = the first
// ST - 1 stages' (kGridEarly), 2 = stage 0's only (kLoopEarly), 0 = none.
template <int BT, int WM, int NW, int NK, int KG, int ST, bool GATED, bool SELF = false,
          int EARLY = 0>
__device__ __forceinline__ void gemm_tile(const GemmArgs& a, const int tile, const int xb,
                                          const int* self_tile_e = nullptr,
                                          const int* self_sorted = nullptr) {
  using S = GemmShape<BT, WM, NW, NK, KG, ST>;
  constexpr int NT = BT / 8;  // n-tiles
  constexpr int T = S::kThreads;
  const int e = SELF ? self_tile_e[tile] : a.tile_expert[tile];
  const int mt0 = xb * S::kMTiles;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp % NW, wk = warp / NW;
  const int kt_count = a.k / S::kBK;
  const int kg_count = a.k / 64;

  // 128-byte aligned: the dynamic region starts after the static variables (red, row_off). With
  // 16-byte alignment a static size of 64 bytes (GEMM1) put the ring 64 bytes into a 128-byte
  // row, so each cp.async wrote every row in 2 shared-memory wavefronts (M = 2-128 3-6% slower);
  // a size 16 off a 32-byte sector made every cp.async touch 2x the L2 sectors and 3x the
  // wavefronts, the main loop 1.75x slower (ncu).
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float red[NW][BT];
  __shared__ long long row_off[BT];  // element offset of each token row in act_in, -1 = padding

  // Per-thread copy sources, fixed for the whole K loop (stage kt adds kt * stage stride).
  const uint4* codes_e = a.codes + (static_cast<long long>(e) * a.mt + mt0) * kg_count * 32;
  const uint4* scales_e = a.scales + (static_cast<long long>(e) * a.mt + mt0) * kg_count * 8;
  const uint4* wsrc[S::kWPer];
  const uint4* ssrc[S::kSPer];
  constexpr int kChunksPerRow = S::kBK / 8;
  static_assert(T % kChunksPerRow == 0, "a thread copies one fixed chunk column of rows");
#pragma unroll
  for (int i = 0; i < S::kWPer; ++i) {
    const int c = tid + i * T;
    const int m = c / (KG * 32), rem = c % (KG * 32);
    wsrc[i] = codes_e + static_cast<long long>(m) * kg_count * 32 + rem;
  }
#pragma unroll
  for (int i = 0; i < S::kSPer; ++i) {
    const int c = tid + i * T;
    const int m = c / (KG * 8), rem = c % (KG * 8);
    ssrc[i] = scales_e + static_cast<long long>(m) * kg_count * 8 + rem;
  }
  auto load_weights = [&](int slot, int kt) {
    uint8_t* base = smem + slot * S::kStageBytes;
    const uint32_t w_s = smem_addr(base);
    const uint32_t s_s = smem_addr(base + S::kWBytes);
#pragma unroll
    for (int i = 0; i < S::kWPer; ++i) {
      const int c = tid + i * T;
      if (S::kWChunks % T == 0 || c < S::kWChunks)
        cp_async16(w_s + c * 16, wsrc[i] + kt * (KG * 32), 16);
    }
#pragma unroll
    for (int i = 0; i < S::kSPer; ++i) {
      const int c = tid + i * T;
      if (S::kSChunks % T == 0 || c < S::kSChunks)
        cp_async16(s_s + c * 16, ssrc[i] + kt * (KG * 8), 16);
    }
  };
  if constexpr (EARLY > 0) {  // before the token indices; they join stage 0's commit group below
#pragma unroll
    for (int s = 0; s < (EARLY == 1 ? ST - 1 : 1); ++s)
      if (s < kt_count) load_weights(s, s);
  }
  for (int i = tid; i < BT; i += T) {
    const int pos = tile * BT + i;
    const int r = SELF ? self_sorted[pos] : a.sorted_route[pos];
    if constexpr (GATED)
      row_off[i] = r >= 0 ? static_cast<long long>(r / a.top_k) * a.k : -1;
    else  // padding positions (no route): zero-filled, not copied (GEMM1 wrote zeros there)
      row_off[i] = r >= 0 ? static_cast<long long>(pos) * a.k : -1;
  }
  __syncthreads();
  const int a_ch = tid % kChunksPerRow;  // this thread's 16-byte column of every row it copies
  const int a_row0 = tid / kChunksPerRow;
  // The token copies, fixed for the whole K loop: source (stage kt adds kt * BK) and swizzled
  // destination of each row this thread copies; padding rows (no route) are zero-filled in each
  // ring slot's first use only, and then stay zero (their slot offsets never change within a
  // work item; a next item of the same block zero-fills again in its first ST stages).
  constexpr int kRowsPerPass = T / kChunksPerRow;
  const uint16_t* asrc[S::kAPer];
  uint32_t adst[S::kAPer];
  bool areal[S::kAPer];
#pragma unroll
  for (int i = 0; i < S::kAPer; ++i) {
    const int row = a_row0 + i * kRowsPerPass;
    const long long ro = (S::kAChunks % T == 0 || row < BT) ? row_off[row] : -1;
    areal[i] = ro >= 0;
    asrc[i] = a.act_in + (ro >= 0 ? ro : 0) + a_ch * 8;
    adst[i] = (row * kChunksPerRow + ((a_ch & ~7) | ((a_ch ^ row) & 7))) * 16;
  }

  auto load_tokens = [&](int slot, int kt) {
    const uint32_t a_s = smem_addr(smem + slot * S::kStageBytes + S::kWBytes + S::kSBytes);
#pragma unroll
    for (int i = 0; i < S::kAPer; ++i) {
      if ((S::kAChunks % T == 0 || a_row0 + i * kRowsPerPass < BT) && (areal[i] || kt < ST))
        cp_async16(a_s + adst[i], asrc[i] + kt * S::kBK, areal[i] ? 16 : 0);
    }
  };
  auto load_stage = [&](int slot, int kt) {
    load_weights(slot, kt);
    load_tokens(slot, kt);
  };

  float acc[WM][NT][4];
#pragma unroll
  for (int w = 0; w < WM; ++w)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[w][n][c] = 0.0f;

#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < kt_count) {
      if (EARLY == 1 || (EARLY == 2 && s == 0))
        load_tokens(s, s);
      else
        load_stage(s, s);
    }
    cp_async_commit();
  }

  const int g = lane >> 2;
  // Unrolled by ST: stage kt0 + s sits in ring slot s, a compile-time offset (no "kt % ST").
  for (int kt0 = 0; kt0 < kt_count; kt0 += ST) {
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      const int kt = kt0 + s;
      if (kt >= kt_count) break;
      cp_async_wait<ST - 2>();
      __syncthreads();
      {
        const int next = kt + ST - 1;
        if (next < kt_count) load_stage((s + ST - 1) % ST, next);
        cp_async_commit();
      }
      const uint8_t* base = smem + s * S::kStageBytes;
      const uint8_t* w_s = base;
      const uint8_t* s_s = base + S::kWBytes;
      const uint32_t a_s = smem_addr(base + S::kWBytes + S::kSBytes);
#pragma unroll
      for (int kgi = 0; kgi < KG / NK; ++kgi) {
        const int kg = kgi * NK + wk;
        uint4 q[WM];
        uint4 sc[WM];
#pragma unroll
        for (int w = 0; w < WM; ++w) {
          const int m = wm * WM + w;
          q[w] = *reinterpret_cast<const uint4*>(w_s + (m * KG + kg) * 512 + lane * 16);
          sc[w] = *reinterpret_cast<const uint4*>(s_s + (m * KG + kg) * 128 + g * 16);
        }
        kgroup_mma<WM, NT>(acc, q, sc, a_s, b_lane_off(kChunksPerRow, lane), kg, kChunksPerRow);
      }
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();

  // Split-K: the NK k-warps' partial sums meet in k-warp 0 (pipeline memory is idle now).
  if constexpr (NK > 1) {
    __syncthreads();
    splitk_reduce<WM, NT, NW, NK>(acc, reinterpret_cast<float*>(smem), wm, wk, lane);
  }

  gemm_epilogue<BT, WM, NW, GATED>(a, acc, e, tile, xb, mt0, wm, wk == 0, red);
}

// gemm_tile's EARLY per kernel. The one-tile grid (moe_gemm_kernel) issues the first ST - 1
// stages' weights early (measured on the H200 against none: M = 16 0.97x). The kernels that loop
// over tiles (loop, spread, self-routed) issue stage 0's only (against none: M = 1 0.98-0.99x,
// M = 2-8 0.97-0.98x; the first ST - 1 stages there: 1.00-1.02x).
constexpr int kGridEarly = 1;
constexpr int kLoopEarly = 2;

// Block row y of a grid with fewer rows than tiles: tiles y, y + rows, ... (the loop kernel, the
// one-tile grid's OVF instances).
template <int BT, int WM, int NW, int NK, int KG, int ST, bool GATED, int EARLY>
__device__ __forceinline__ void gemm_tile_rows(const GemmArgs& a, const int num_tiles) {
  const int first = blockIdx.y;
  for (int tile = first; tile < num_tiles; tile += gridDim.y) {
    if (tile != first) __syncthreads();  // the last item's memory is free
    gemm_tile<BT, WM, NW, NK, KG, ST, GATED, false, EARLY>(a, tile, blockIdx.x);
  }
}

// v6 one-tile grid: grid (n-blocks, t_max); blocks past num_tiles exit.
// OVF: grid (n-blocks, R) with R < t_max rows (one_tile_rows): block row y runs tile y, then
// (only when the call has more than R tiles) y + R, y + 2R, ... The worst-case grid is mostly
// blocks past num_tiles (at M = 128 ~80%), dispatched after every real block: they enter up to
// 10 us after the last real block is done, and the next kernel launches only behind them.
// Spreading them among the real ones instead (tiles along x) measured 1.02-1.03x at M = 16-64,
// the loop kernel on capped rows 1.03x at M = 16-64 (its code) and 0.98x at M = 128.
template <int BT, int WM, int NW, int NK, int KG, int ST, bool GATED, bool OVF = false>
__global__ void __launch_bounds__(NW * NK * 32) moe_gemm_kernel(const GemmArgs a) {
  const int tile = blockIdx.y;
  pdl_wait();
  const int num_tiles = *a.num_tiles;
  if (tile >= num_tiles) return;
  if constexpr (OVF) {
    // One gemm_tile call site: half the code of a tile-then-loop form, whose two calls ptxas
    // inlines both, at the same time (H200, M = 64-128: 0.998-1.005x).
    gemm_tile_rows<BT, WM, NW, NK, KG, ST, GATED, kGridEarly>(a, num_tiles);
  } else {
    gemm_tile<BT, WM, NW, NK, KG, ST, GATED, false, kGridEarly>(a, tile, blockIdx.x);
  }
}

// v6 on a grid of fewer rows than t_max (grid_rows): each block loops over tiles y, y + rows, ...
// A kernel of its own: the loop raises ptxas's register use (a block of 8 split-K warps went from
// 40 to 88 registers, one block per SM), and the one-tile grid must not pay for it. MB: blocks
// per SM asked of ptxas: 2 for calls of <= kCapTwoMaxRoutes routes (60-100 registers); loop_mb
// (64 registers) for larger capped calls, which need the one-tile grid's occupancy.
template <int BT, int WM, int NW, int NK, int KG, int ST, bool GATED, int MB>
__global__ void __launch_bounds__(NW * NK * 32, MB)
    moe_gemm_loop_kernel(const GemmArgs a) {
  pdl_wait();
  const int num_tiles = *a.num_tiles;
  gemm_tile_rows<BT, WM, NW, NK, KG, ST, GATED, kLoopEarly>(a, num_tiles);
}

// GEMM2 at decode with its items spread over the SMs (calls GEMM1 routed itself:
// moe_gemm_self_kernel zeroes the slot counters; grid P x S, sms = S, spread_launch). Item
// = tile * n-blocks + n-block. The block scheduler fills some SMs (ids 124-131 on the H200) with
// more of a grid's first blocks than others, so the (n-blocks, rows) grid of a 2-tile call at
// M = 2 put 3 of its 256 real blocks on 8 SMs and 1 on 16 (GEMM2 10.2 us where 2 per SM stream
// in ~7, from per-block timestamps). Here each block takes a place q = slot S + sm, its SM's
// next free slot (an atomic counter per SM), and runs items q, q + P S, ..., so item i runs on SM
// i % S and every call's items are spread evenly. Places are handed out exactly once whatever
// the placement (a block whose SM already gave out its P slots takes a free one elsewhere: there
// are as many places as blocks), so the results never depend on it, only the balance does.
constexpr int kSlotsOff = 32;  // the per-SM counters: num_tiles + kSlotsOff (one carve)
constexpr int kMaxSlots = 256;
__device__ __forceinline__ unsigned sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ int spread_place(int* slots, const int per_sm, const int sms) {
  const unsigned sm = sm_id();
  if (sm < static_cast<unsigned>(sms)) {
    const int t = atomicAdd(&slots[sm], 1);
    if (t < per_sm) return t * sms + static_cast<int>(sm);
  }
  for (;;)  // this SM gave out its slots (blocks that exited early let later ones in): any free
    for (int j = 0; j < sms; ++j)
      if (*reinterpret_cast<volatile int*>(&slots[j]) < per_sm) {
        const int t = atomicAdd(&slots[j], 1);
        if (t < per_sm) return t * sms + j;
      }
}
template <int BT, int WM, int NW, int NK, int KG, int ST, int MB>
__global__ void __launch_bounds__(NW * NK * 32, MB)
    moe_gemm_spread_kernel(const GemmArgs a, const int sms) {
  __shared__ int place;
  pdl_wait();
  const int num_tiles = *a.num_tiles;  // in flight with the slot's atomic
  if (threadIdx.x == 0)
    place = spread_place(const_cast<int*>(a.num_tiles) + kSlotsOff, gridDim.x / sms, sms);
  __syncthreads();
  const int nb = a.mt / (NW * WM), items = num_tiles * nb, first = place;
  for (int it = first; it < items; it += gridDim.x) {
    if (it != first) __syncthreads();  // the last item's memory is free
    gemm_tile<BT, WM, NW, NK, KG, ST, false, false, kLoopEarly>(a, it / nb, it % nb);
  }
}

// Small calls route themselves: a call of at most kSelfMaxRoutes routes on a shard of at most
// kSelfMaxExperts experts on a capped v6 grid (BT 8, M <= 8 at top-8) launches no route_kernel.
// Each GEMM1 block's first warp computes the whole routing from topk_ids (two routes per lane: a
// handful of shuffles) into shared memory, so GEMM1 does not wait for a one-block kernel (~3 us at
// M = 1, routing 8 routes) and its blocks read no index from global memory; block (0, 0) also
// writes route_kernel's tables (num_tiles, tile_expert, sorted_route, pos_of_route) for GEMM2 and
// finalize, which read them after their waits. The positions are route_kernel's (each expert's
// routes padded to whole tiles, experts in local order), an expert's routes in route order
// (route_kernel's order inside an expert follows its shared-memory atomics; a route's output
// depends on its own row only, so the bits are the same). Measured on the H200 against
// route_kernel + the loop kernel: M = 1 0.94-0.95x (-1.1 us), 2 0.96x, 4 0.97-0.98x, 8 0.99-1.00x.
constexpr int kSelfMaxRoutes = 64;
constexpr int kSelfMaxExperts = 32;  // one lane per local expert
struct SelfRoute {
  const int* topk_ids;
  const int* local_of;
  int first;  // >= 0: the shard's ids are first .. first + el - 1 (local_expert)
  int* num_tiles;
  int* tile_expert;
  int* sorted_route;
  int* pos_of_route;
  int routes;
  int num_experts;
  int el;
};

// One warp (lane = threadIdx.x < 32) routes the call: tile_e[t], the local expert of tile t;
// sorted[p], the route at position p (-1: padding) for p < the returned tile count * BT; cnt: 32
// ints of scratch. Lanes take routes lane and lane + 32; p0 / p1 their positions (-1: not local).
template <int BT>
__device__ __forceinline__ int self_route(const SelfRoute& s, const int lane, int* cnt,
                                          int* tile_e, int* sorted, int& p0, int& p1) {
  constexpr unsigned kAll = 0xffffffffu;
  const int r0 = lane, r1 = lane + 32;
  const int e0 =
      r0 < s.routes ? local_expert(s.topk_ids, s.local_of, s.first, r0, s.num_experts, s.el) : -1;
  const int e1 =
      r1 < s.routes ? local_expert(s.topk_ids, s.local_of, s.first, r1, s.num_experts, s.el) : -1;
  cnt[lane] = 0;
  const unsigned lt = (1u << lane) - 1;
  const unsigned peers0 = __match_any_sync(kAll, e0), peers1 = __match_any_sync(kAll, e1);
  const int rank0 = __popc(peers0 & lt), before1 = __popc(peers1 & lt);
  __syncwarp();
  if (e0 >= 0 && rank0 == 0) cnt[e0] = __popc(peers0);  // one leader per expert
  __syncwarp();
  const int rank1 = (e1 >= 0 ? cnt[e1] : 0) + before1;  // after the expert's first-half routes
  __syncwarp();
  if (e1 >= 0 && before1 == 0) cnt[e1] += __popc(peers1);
  __syncwarp();
  const int padded = (cnt[lane] + BT - 1) / BT * BT;  // lane = local expert
  int incl = padded;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kAll, incl, o);
    if (lane >= o) incl += v;
  }
  const int off = incl - padded;
  const int total = __shfl_sync(kAll, incl, 31);
  const int off0 = __shfl_sync(kAll, off, e0 & 31), off1 = __shfl_sync(kAll, off, e1 & 31);
  p0 = e0 >= 0 ? off0 + rank0 : -1;
  p1 = e1 >= 0 ? off1 + rank1 : -1;
  for (int t = off / BT; t < incl / BT; ++t) tile_e[t] = lane;
  for (int p = lane; p < total; p += 32) sorted[p] = -1;
  __syncwarp();
  if (p0 >= 0) sorted[p0] = r0;
  if (p1 >= 0) sorted[p1] = r1;
  __syncwarp();
  return total / BT;
}

// GEMM1 (gate / up) of a small call on a capped v6 grid, routing itself (above). MB: as
// moe_gemm_loop_kernel's (2 for calls of <= kCapTwoMaxRoutes routes: 102 registers, 4 blocks per
// SM, so M = 1's GEMM1 blocks run in one wave).
template <int BT, int WM, int NW, int NK, int KG, int ST, int MB>
__global__ void __launch_bounds__(NW * NK * 32, MB)
    moe_gemm_self_kernel(const GemmArgs a, const SelfRoute s) {
  constexpr int kMaxTiles = kSelfMaxRoutes / BT + kSelfMaxExperts;  // t_max's bound
  static_assert(NW * NK >= 2, "warp 0 routes, the others zero GEMM2's slot counters");
  __shared__ int cnt[32];
  __shared__ int tile_e[kMaxTiles + 1];  // + the tile count
  __shared__ int sorted[kMaxTiles * BT];
  const bool tables = blockIdx.x == 0 && blockIdx.y == 0;  // this block writes the tables
  pdl_wait();  // the previous kernel on the stream (the last call's finalize reads pos_of_route)
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int p0, p1;
    const int nt = self_route<BT>(s, lane, cnt, tile_e, sorted, p0, p1);
    if (lane == 0) tile_e[kMaxTiles] = nt;
    if (tables) {
      if (lane == 0) *s.num_tiles = nt;
      for (int t = lane; t < nt; t += 32) s.tile_expert[t] = tile_e[t];
      for (int p = lane; p < nt * BT; p += 32) s.sorted_route[p] = sorted[p];
      if (lane < s.routes) s.pos_of_route[lane] = p0;
      if (lane + 32 < s.routes) s.pos_of_route[lane + 32] = p1;
    }
  } else if (tables) {  // moe_gemm_spread_kernel's per-SM slot counters for this call
    for (int i = threadIdx.x - 32; i < kMaxSlots; i += blockDim.x - 32)
      s.num_tiles[kSlotsOff + i] = 0;
  }
  __syncthreads();
  const int num_tiles = tile_e[kMaxTiles];
  for (int tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
    if (tile != static_cast<int>(blockIdx.y)) __syncthreads();  // the last item's memory is free
    gemm_tile<BT, WM, NW, NK, KG, ST, true, true, kLoopEarly>(a, tile, blockIdx.x, tile_e, sorted);
  }
}

// ------------------------------------ v8: warpgroup MMA --------------------------------------

// wgmma_fence / wgmma_commit / wgmma_wait, reg_fence and smem_desc_sw128: wgmma.cuh.

template <int BT, int NWG, int WM, int KG, int ST, int MB>
struct WgShape {
  static constexpr int kThreads = NWG * 128;
  static constexpr int kWarps = NWG * 4;
  static constexpr int kMTiles = kWarps * WM;  // warp w holds m-tiles w WM .. w WM + WM - 1
  static constexpr int kBK = 64 * KG;
  static constexpr int kABytes = BT * KG * 128;  // tokens: [KG][BT rows][128 B], swizzled
  static constexpr int kWBytes = kMTiles * KG * 512;
  static constexpr int kSBytes = kMTiles * KG * 128;
  static constexpr int kStageBytes = kABytes + kWBytes + kSBytes;
  // Room to align the ring to 1024 bytes (the 128-byte swizzle's atom): the dynamic area starts
  // right after the kernel's static shared memory (a misaligned ring computes garbage without
  // faulting), so the pad needed is (-static) mod 1024; 1024 covers any static size. BT 32 takes
  // 896 (its statics are 1152 / 2176 B, 128 mod 1024), which fits 3 GEMM2 blocks of KG 2 / ST 4
  // in an SM's 228 KB (3 x 77,824 B with the 1 KB each block reserves). set_smem_attrs_v8 checks
  // the pad against the statics at start-up.
  static constexpr int kAlignPad = BT == 32 ? 896 : 1024;
  static constexpr int kSmemBytes = kStageBytes * ST + kAlignPad;
  static constexpr int kChunksPerRow = KG * 8;
  static constexpr int kAChunks = BT * kChunksPerRow, kWChunks = kWBytes / 16,
                       kSChunks = kSBytes / 16;
  static constexpr int kAPer = (kAChunks + kThreads - 1) / kThreads;
  static constexpr int kWPer = (kWChunks + kThreads - 1) / kThreads;
  static constexpr int kSPer = (kSChunks + kThreads - 1) / kThreads;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(BT % 16 == 0 && BT <= 256, "wgmma N: tiles in steps of 16, at most 256");
  static_assert(kStageBytes % 1024 == 0, "stages hold whole 1024-byte swizzle atoms");
  static_assert(kThreads % kChunksPerRow == 0 && kRowsPerPass % 8 == 0,
                "a thread copies one chunk column of rows with one swizzle phase");
  static_assert(ST >= 2 && MB >= 1, "one stage computed while the others load");
  static_assert(BT <= kThreads, "one token row per thread");
};

// Dequantize one "unit" of this warp's A fragments (its WM m-tiles, U k-steps of k-group kg from
// k-step ks0; U = 4 or 2) from a stage's shared-memory codes and scales into registers.
template <int WM, int KG, int U>
__device__ __forceinline__ void dequant_unit(const uint8_t* w_s, const uint8_t* s_s, int warp,
                                             int lane, int kg, int ks0,
                                             uint32_t (&af)[WM][U][4]) {
  const int g = lane >> 2;
#pragma unroll
  for (int j = 0; j < WM; ++j) {
    const int m = warp * WM + j;
    const uint8_t* wp = w_s + (m * KG + kg) * 512 + lane * 16 + ks0 * 4;
    const uint8_t* sp = s_s + (m * KG + kg) * 128 + g * 16 + ks0 * 4;
    uint32_t words[U], scl[U];
    if constexpr (U == 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(wp);
      const uint4 sc = *reinterpret_cast<const uint4*>(sp);
      words[0] = q.x, words[1] = q.y, words[2] = q.z, words[3] = q.w;
      scl[0] = sc.x, scl[1] = sc.y, scl[2] = sc.z, scl[3] = sc.w;
    } else {
      static_assert(U == 2, "units of 4 or 2 k-steps");
      const uint2 q = *reinterpret_cast<const uint2*>(wp);
      const uint2 sc = *reinterpret_cast<const uint2*>(sp);
      words[0] = q.x, words[1] = q.y;
      scl[0] = sc.x, scl[1] = sc.y;
    }
#pragma unroll
    for (int ks = 0; ks < U; ++ks) {
      uint32_t r[4];
      e2m1x8_to_bf16x8(words[ks], r);
      af[j][ks][0] = bf16x2_mul_lo(r[0], scl[ks]);
      af[j][ks][1] = bf16x2_mul_hi(r[1], scl[ks]);
      af[j][ks][2] = bf16x2_mul_lo(r[2], scl[ks]);
      af[j][ks][3] = bf16x2_mul_hi(r[3], scl[ks]);
    }
  }
}

// Dequantize one stage's A fragments of this warp (KG k-groups x 4 k-steps).
template <int WM, int KG>
__device__ __forceinline__ void dequant_stage(const uint8_t* w_s, const uint8_t* s_s, int warp,
                                              int lane, uint32_t (&af)[WM][4 * KG][4]) {
#pragma unroll
  for (int kg = 0; kg < KG; ++kg) {
    uint32_t u[WM][4][4];
    dequant_unit<WM, KG, 4>(w_s, s_s, warp, lane, kg, 0, u);
#pragma unroll
    for (int j = 0; j < WM; ++j)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int c = 0; c < 4; ++c) af[j][kg * 4 + ks][c] = u[j][ks][c];
  }
}

// The stage's WM x 4 KG wgmma m64nNk16 (N = the tile's rows in use), committed as one group. The
// A registers are pinned first: register-only code scheduled between the wgmmas makes ptxas
// serialize them (C7513).
// desc0: the descriptor of the stage's token tile (k-step 0); a k-step's is desc0 plus its byte
// offset / 16 (the start-address field, bits 0-13, cannot carry: shared memory < 256 KB), so
// the descriptors cost one add each, not the full encoding.
template <int BT, int WM, int KG, int N>
__device__ __forceinline__ void issue_stage(uint32_t (&af)[WM][4 * KG][4],
                                            float (&acc)[WM][BT / 2], uint64_t desc0) {
#pragma unroll
  for (int j = 0; j < WM; ++j)
#pragma unroll
    for (int i = 0; i < 4 * KG; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) reg_fence(af[j][i][c]);
  wgmma_fence();  // the A registers written before, ahead of the wgmmas that read them
#pragma unroll
  for (int kg = 0; kg < KG; ++kg)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t desc = desc0 + ((kg * (BT * 128) + ks * 32) >> 4);
#pragma unroll
      for (int j = 0; j < WM; ++j)
        Wgmma<N>::mma(reinterpret_cast<float(&)[N / 2]>(acc[j]), af[j][kg * 4 + ks], desc);
    }
  wgmma_commit();
}

// Ring 3: one unit's wgmmas (as issue_stage does for a stage), committed as one group.
template <int BT, int WM, int U, int N>
__device__ __forceinline__ void issue_unit(uint32_t (&af)[WM][U][4], float (&acc)[WM][BT / 2],
                                           uint64_t desc0, int kg, int ks0) {
#pragma unroll
  for (int j = 0; j < WM; ++j)
#pragma unroll
    for (int i = 0; i < U; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) reg_fence(af[j][i][c]);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < U; ++ks) {
    const uint64_t desc = desc0 + ((kg * (BT * 128) + (ks0 + ks) * 32) >> 4);
#pragma unroll
    for (int j = 0; j < WM; ++j)
      Wgmma<N>::mma(reinterpret_cast<float(&)[N / 2]>(acc[j]), af[j][ks], desc);
  }
  wgmma_commit();
}

// The copy sources of a v8 block's weights and scales (fixed for the whole K loop: stage kt adds
// kt stages) and one stage's copies of them into the ring slot at base (v8_tile).
template <typename S>
__device__ __forceinline__ void v8_weight_srcs(const GemmArgs& a, const int e, const int mt0,
                                               const uint4* (&wsrc)[S::kWPer],
                                               const uint4* (&ssrc)[S::kSPer]) {
  constexpr int T = S::kThreads, KG = S::kBK / 64;
  const int tid = threadIdx.x;
  const int kg_count = a.k / 64;
  const uint4* codes_e = a.codes + (static_cast<long long>(e) * a.mt + mt0) * kg_count * 32;
  const uint4* scales_e = a.scales + (static_cast<long long>(e) * a.mt + mt0) * kg_count * 8;
#pragma unroll
  for (int i = 0; i < S::kWPer; ++i) {
    const int c = tid + i * T;
    wsrc[i] = codes_e + static_cast<long long>(c / (KG * 32)) * kg_count * 32 + c % (KG * 32);
  }
#pragma unroll
  for (int i = 0; i < S::kSPer; ++i) {
    const int c = tid + i * T;
    ssrc[i] = scales_e + static_cast<long long>(c / (KG * 8)) * kg_count * 8 + c % (KG * 8);
  }
}
template <typename S>
__device__ __forceinline__ void v8_copy_weights(const uint32_t base,
                                                const uint4* const (&wsrc)[S::kWPer],
                                                const uint4* const (&ssrc)[S::kSPer],
                                                const int kt) {
  constexpr int T = S::kThreads, KG = S::kBK / 64;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < S::kWPer; ++i) {
    const int c = tid + i * T;
    if (S::kWChunks % T == 0 || c < S::kWChunks)
      cp_async16(base + S::kABytes + c * 16, wsrc[i] + kt * (KG * 32), 16);
  }
#pragma unroll
  for (int i = 0; i < S::kSPer; ++i) {
    const int c = tid + i * T;
    if (S::kSChunks % T == 0 || c < S::kSChunks)
      cp_async16(base + S::kABytes + S::kWBytes + c * 16, ssrc[i] + kt * (KG * 8), 16);
  }
}

// One work item (tile x n-block) with wgmma width N <= BT: the tile's first N rows (its valid
// routes rounded up to 16; the rest is padding whose accumulators stay 0). Warp w owns m-tiles
// mt0 + w WM + j for all of K. Per stage each warp dequantizes its A fragments into registers,
// its warpgroup issues the stage's wgmmas back to back, and waits for them before the next stage.
// Overlap of dequantization and tensor work comes from the other warpgroups on the SM: keeping
// wgmmas in flight while the next stage is dequantized into the A registers makes ptxas
// serialize every wgmma (C7513: no non-wgmma definition of a wgmma input register while wgmmas
// are in flight); ring 3 below dequantizes into a second register set instead.
// Sums in k order into one accumulator per thread (no split-K): other fp32 rounding than v6.
// RING 2 (BT 16, 32, 64): the block-barrier ring with a stage's copies issued after its wgmmas,
// not before its dequantization (the math starts right at the barrier; the slot refilled is stage
// kt - 1's, which the barrier already freed). RING 3 (BT 48 and from BT 96): ring 2 pipelined,
// the next unit dequantized under the current unit's wgmmas. Both compute the same bits; the
// v8 configurations (V8Bt16 ... V8Bt160) give each tile size its ring and the measurements.
template <int BT, int NWG, int WM, int KG, int ST, int MB, bool GATED, int N, int RING>
__device__ __forceinline__ void v8_tile(const GemmArgs& a, const int tile, const int xb,
                                        const int e, const int (&row_off)[BT],
                                        float (&red)[NWG * 4][BT], uint8_t* smem_raw) {
  using S = WgShape<BT, NWG, WM, KG, ST, MB>;
  constexpr int NT = BT / 8;
  const int mt0 = xb * S::kMTiles;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kt_count = a.k / S::kBK;
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t smem0 = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem0 - raw);

  const uint4* wsrc[S::kWPer];
  const uint4* ssrc[S::kSPer];
  v8_weight_srcs<S>(a, e, mt0, wsrc, ssrc);
  // Token copies: a thread's 16-byte column (k-group, chunk) of rows a_row0 + i * pass; every
  // such row has the same row % 8, so one swizzled destination column. Sources fixed for the
  // whole K loop (stage kt adds kt * BK). Rows >= N: never copied (the wgmmas read N rows);
  // padding rows below N are zero-filled in each ring slot's first use only and stay zero.
  const int a_ch = tid % S::kChunksPerRow, a_row0 = tid / S::kChunksPerRow;
  const int a_dst0 = (a_ch / 8) * (BT * 128) + a_row0 * 128 + (((a_ch % 8) ^ a_row0) & 7) * 16;
  // Element offsets, not pointers: 32-bit registers (BT 160 spilled with 64-bit pointers).
  int aoff[S::kAPer];
  bool areal[S::kAPer];
#pragma unroll
  for (int i = 0; i < S::kAPer; ++i) {
    const int row = a_row0 + i * S::kRowsPerPass;
    const int ro = row < N ? row_off[row] : -1;
    areal[i] = ro >= 0;
    aoff[i] = (ro >= 0 ? ro : 0) + a_ch * 8;
  }

  auto load_tokens = [&](int slot, int kt) {
    const uint32_t base = smem0 + slot * S::kStageBytes;
#pragma unroll
    for (int i = 0; i < S::kAPer; ++i) {
      if (a_row0 + i * S::kRowsPerPass < N && (areal[i] || kt < ST))
        cp_async16(base + a_dst0 + i * S::kRowsPerPass * 128, a.act_in + (aoff[i] + kt * S::kBK),
                   areal[i] ? 16 : 0);
    }
  };
  auto load_stage = [&](int slot, int kt) {
    v8_copy_weights<S>(smem0 + slot * S::kStageBytes, wsrc, ssrc, kt);
    load_tokens(slot, kt);
  };

  float acc[WM][BT / 2];
#pragma unroll
  for (int j = 0; j < WM; ++j)
#pragma unroll
    for (int i = 0; i < BT / 2; ++i) acc[j][i] = 0.0f;
  uint32_t af[WM][4 * KG][4];
  const uint64_t desc_base = smem_desc_sw128(smem0);

  static_assert(RING == 2 || RING == 3, "v8 rings: 2 and 3");
  if constexpr (RING == 3) {
    // Ring 3: each warp dequantizes the next unit into the other register set while
    // the current unit's wgmmas run (no wgmma input register is written while wgmmas that read
    // it are in flight, and every wait is wait_group 0). Copies run ST - 2 stages ahead: at the
    // barrier between stages kt and kt + 1 a warp's last unit of kt may still be in flight, so
    // the slot refilled there is stage kt - 1's (all its wgmmas waited before the barrier).
    // Units of 4 k-steps (2 at KG 1); units of 2 at every KG measured 1.00-1.05x slower at BT 48
    // even with a third block per SM.
    constexpr int U = KG >= 2 ? 4 : 2;
    constexpr int UPS = 4 * KG / U;  // units per stage: even, so unit 0 always uses set A
    constexpr int D = ST - 2;
    static_assert(UPS % 2 == 0 && D >= 1, "ring 3 needs an even unit count and ST >= 3");
    uint32_t afa[WM][U][4], afb[WM][U][4];
#pragma unroll
    for (int s = 0; s < D; ++s) {
      if (s < kt_count) load_stage(s, s);
      cp_async_commit();
    }
    cp_async_wait<D - 1>();
    __syncthreads();
    if (D < kt_count) load_stage(D % ST, D);
    cp_async_commit();
    {
      const uint8_t* w_s = smem + S::kABytes;
      dequant_unit<WM, KG, U>(w_s, w_s + S::kWBytes, warp, lane, 0, 0, afa);
    }
    // Unrolled by ST (ring slots compile-time constants) for BT 96-144; BT 160 (6 stages of 4
    // warpgroups) keeps the loop.
    auto stage3 = [&](const int kt, const int slot, const int slot_next) {
      const uint64_t desc = desc_base + ((slot * S::kStageBytes) >> 4);
      const uint8_t* w_s = smem + slot * S::kStageBytes + S::kABytes;
#pragma unroll
      for (int u = 0; u < UPS; ++u) {
        auto& cur = (u % 2 == 0) ? afa : afb;
        auto& nxt = (u % 2 == 0) ? afb : afa;
        issue_unit<BT, WM, U, N>(cur, acc, desc, (u * U) / 4, (u * U) % 4);
        if (u + 1 < UPS) {
          dequant_unit<WM, KG, U>(w_s, w_s + S::kWBytes, warp, lane, ((u + 1) * U) / 4,
                                  ((u + 1) * U) % 4, nxt);
        } else if (kt + 1 < kt_count) {
          cp_async_wait<D - 1>();
          __syncthreads();  // stage kt + 1 visible; every warp waited all of stage kt - 1
          const int next = kt + 1 + D;  // into the slot of stage kt - 1
          if (next < kt_count) load_stage(next % ST, next);
          cp_async_commit();
          const uint8_t* w_n = smem + slot_next * S::kStageBytes + S::kABytes;
          dequant_unit<WM, KG, U>(w_n, w_n + S::kWBytes, warp, lane, 0, 0, nxt);
        }
        wgmma_wait<0>();
      }
    };
    if constexpr (BT < 160) {
      for (int kt0 = 0; kt0 < kt_count; kt0 += ST) {
#pragma unroll
        for (int s = 0; s < ST; ++s)
          if (kt0 + s < kt_count) stage3(kt0 + s, s, (s + 1) % ST);
      }
    } else {
      for (int kt = 0; kt < kt_count; ++kt) stage3(kt, kt % ST, (kt + 1) % ST);
    }
    cp_async_wait<0>();
  } else {
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
      if (s < kt_count) load_stage(s, s);
      cp_async_commit();
    }
    // Unrolled by ST: stage kt0 + s sits in ring slot s (compile-time smem and descriptor
    // offsets, no "kt % ST"). From BT 96 the unrolled ring 2 spills, and those tiles run ring 3.
    static_assert(BT < 96, "ring 2 is compiled for tiles below 96");
    auto stage = [&](const int kt, const int slot) {  // slot is a constant
      cp_async_wait<ST - 2>();
      __syncthreads();  // stage kt visible; every warp is done with stage kt - 1 (wgmmas waited)
      const int next = kt + ST - 1;  // into the slot of stage kt - 1
      const uint8_t* w_s = smem + slot * S::kStageBytes + S::kABytes;
      dequant_stage<WM, KG>(w_s, w_s + S::kWBytes, warp, lane, af);
      issue_stage<BT, WM, KG, N>(af, acc, desc_base + ((slot * S::kStageBytes) >> 4));
      // The copies after this stage's math: it starts right at the barrier.
      if (next < kt_count) load_stage((slot + ST - 1) % ST, next);
      cp_async_commit();
      wgmma_wait<0>();  // this stage's slot and the A registers are free again
    };
    for (int kt0 = 0; kt0 < kt_count; kt0 += ST) {
#pragma unroll
      for (int s = 0; s < ST; ++s)
        if (kt0 + s < kt_count) stage(kt0 + s, s);
    }
    cp_async_wait<0>();
  }
  pdl_launch_dependents();
  gemm_epilogue<BT, WM, S::kWarps, GATED>(a, reinterpret_cast<const float(&)[WM][NT][4]>(acc),
                                           e, tile, xb, mt0, warp, true, red);
}

// The wgmma width for a tile with `rows` valid routes: the smallest of 8 (BT 16 only: at BT 32 the
// extra mainloop makes ptxas spill), 16, 32, ... that is >= rows, at BT 16, 32 and from BT 64;
// 32 or 48 at BT 48. MMAs on padding cost time: in compute-bound calls, and where a tile holds
// few routes the dequantization's ALU work and the MMAs add up, so an MMA half as wide is ~5-12%
// cheaper per weight; at the board's power cap (from M = 16) they cost energy too (every tile at
// N = BT measured +5% energy per call at M = 512, +7-12% at 2048, H200). BT 48's tiles of <= 32
// routes on the 32-wide mainloop: 0.945-1.0x the time at M = 896-1024, 0.98-1.02x at
// 1088-1152; it pays where tiles carry much padding. Every width computes the same bits (the
// padding columns are separate sums).
constexpr int v8_first_n(int bt) {
  return bt == 16 ? 8 : bt == 32 || bt >= 64 ? 16 : bt == 48 ? 32 : bt;
}
constexpr int v8_next_n(int n) { return n < 16 ? 16 : n + 16; }
template <int BT, int NWG, int WM, int KG, int ST, int MB, bool GATED, int RING,
          int N = v8_first_n(BT)>
__device__ __forceinline__ void v8_dispatch(const GemmArgs& a, const int tile, const int xb,
                                            const int e, const int rows,
                                            const int (&row_off)[BT], float (&red)[NWG * 4][BT],
                                            uint8_t* smem_raw) {
  if constexpr (N >= BT) {
    v8_tile<BT, NWG, WM, KG, ST, MB, GATED, BT, RING>(a, tile, xb, e, row_off, red, smem_raw);
  } else {
    if (rows <= N)
      v8_tile<BT, NWG, WM, KG, ST, MB, GATED, N, RING>(a, tile, xb, e, row_off, red, smem_raw);
    else
      v8_dispatch<BT, NWG, WM, KG, ST, MB, GATED, RING, v8_next_n(N)>(a, tile, xb, e, rows,
                                                                       row_off, red, smem_raw);
  }
}

// v8: grid (n-blocks, t_max) as v6; blocks past num_tiles exit. A tile's valid routes are a
// prefix of its positions (route_kernel fills each tile from its first position).
template <int BT, int NWG, int WM, int KG, int ST, int MB, bool GATED, int RING>
__global__ void __launch_bounds__(NWG * 128, MB) moe_gemm_v8_kernel(const GemmArgs a) {
  const int tile = blockIdx.y;
  pdl_wait();
  if (tile >= *a.num_tiles) return;
  const int e = a.tile_expert[tile];
  extern __shared__ uint8_t smem_raw[];
  __shared__ float red[NWG * 4][BT];
  __shared__ int row_off[BT];  // element offset of each token row in act_in, -1 = padding
  const int tid = threadIdx.x;
  bool valid = false;
  if (tid < BT) {
    const int pos = tile * BT + tid;
    const int r = a.sorted_route[pos];
    valid = r >= 0;
    if constexpr (GATED)
      row_off[tid] = valid ? (r / a.top_k) * a.k : -1;  // the host keeps m * k below 2^31
    else
      row_off[tid] = valid ? pos * a.k : -1;  // pcap * k below 2^31 (host); padding: zero-filled
  }
  const int rows = __syncthreads_count(valid);
  v8_dispatch<BT, NWG, WM, KG, ST, MB, GATED, RING>(a, tile, blockIdx.x, e, rows, row_off, red,
                                                    smem_raw);
}

// ------------------------------------ 4. norm + weighted sum ---------------------------------

// Sum of the GEMM2 partial sums of z^2 of the route at position p (0 when p < 0: not owned
// here), in a fixed order (lane-strided, then a shuffle tree); every lane of the warp calls it
// and gets the sum. The coefficient is w / sqrt(sum / H + eps) (route_coef).
__device__ __forceinline__ float route_sq_sum(const int p, const float* __restrict__ partial,
                                              const int nparts, const int pcap, const int lane) {
  float s = 0.0f;
  if (p >= 0)
    for (int q = lane; q < nparts; q += 32)
      s += __ldcg(partial + static_cast<long long>(q) * pcap + p);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}
__device__ __forceinline__ float route_coef(const int p, const float w, const float s,
                                            const int h, const int rms_norm) {
  if (p < 0) return 0.0f;
  return rms_norm ? w / sqrtf(s / static_cast<float>(h) + kRmsEps) : w;
}

// Token t's coefficients coef_j = w_j / rms_j (route_sq_sum, route_coef) and positions (-1: route
// not owned here) into shared memory, one warp per route. Every thread of the block calls it.
__device__ __forceinline__ void finalize_coefs(const int t, const int* __restrict__ pos_of_route,
                                               const float* __restrict__ topk_weights,
                                               const int top_k, const float* __restrict__ partial,
                                               const int nparts, const int pcap, const int h,
                                               const int rms_norm, float* coef, int* pos) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int j = warp; j < top_k; j += nwarps) {
    const long long rj = static_cast<long long>(t) * top_k + j;
    const int p = pos_of_route[rj];
    // Loaded beside p, not after the sum: one dependent L2 round trip fewer (measured M = 1-16
    // 0.985-0.997x, 64-2048 0.974-1.01x)
    const float wj = topk_weights[rj];
    const float sj = route_sq_sum(p, partial, nparts, pcap, lane);
    if (lane == 0) {
      coef[j] = route_coef(p, wj, sj, h, rms_norm);
      pos[j] = p;
    }
  }
  __syncthreads();
}

// acc[0..7] += cj * the 8 bf16 of v (one 16-byte chunk of a z row).
__device__ __forceinline__ void fin_accumulate(float (&acc)[8], const float cj, const uint4 v) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += cj * bf16_bits_to_float(words[i] & 0xFFFFu);
    acc[2 * i + 1] += cj * bf16_bits_to_float(words[i] >> 16);
  }
}
__device__ __forceinline__ void fin_store(const float (&acc)[8], const int t, const int c,
                                          const int h, uint16_t* __restrict__ out) {
  uint4 o;
  o.x = pack_bf16x2(acc[0], acc[1]);
  o.y = pack_bf16x2(acc[2], acc[3]);
  o.z = pack_bf16x2(acc[4], acc[5]);
  o.w = pack_bf16x2(acc[6], acc[7]);
  *reinterpret_cast<uint4*>(out + static_cast<long long>(t) * h + c * 8) = o;
}

// out[t, 8 c .. 8 c + 7] = sum_j coef_j z[pos_j, ...] in route order (zeros without a route).
// The z chunks of up to kFinBatch routes are loaded before any is summed: one L2 round trip per
// batch instead of one per local route (finalize_chunk's loop has each load behind the previous
// route's branch, SASS); the same sums in the same order.
constexpr int kFinBatch = 8;
__device__ __forceinline__ void finalize_chunk_batched(const int t, const int c, const int top_k,
                                                       const float* coef, const int* pos,
                                                       const uint16_t* __restrict__ z,
                                                       const int h, uint16_t* __restrict__ out) {
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int j0 = 0; j0 < top_k; j0 += kFinBatch) {
    uint4 v[kFinBatch];
#pragma unroll
    for (int u = 0; u < kFinBatch; ++u) {
      const int p = j0 + u < top_k ? pos[j0 + u] : -1;
      v[u] = p >= 0 ? __ldcg(reinterpret_cast<const uint4*>(z + static_cast<long long>(p) * h +
                                                            c * 8))
                    : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kFinBatch; ++u)
      if (j0 + u < top_k && pos[j0 + u] >= 0) fin_accumulate(acc, coef[j0 + u], v[u]);
  }
  fin_store(acc, t, c, h, out);
}

// The same, one route after another (fewer registers: 32 against 59 for the kernel).
__device__ __forceinline__ void finalize_chunk(const int t, const int c, const int top_k,
                                               const float* coef, const int* pos,
                                               const uint16_t* __restrict__ z, const int h,
                                               uint16_t* __restrict__ out) {
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int p = pos[j];
    if (p < 0) continue;
    fin_accumulate(
        acc, coef[j],
        __ldcg(reinterpret_cast<const uint4*>(z + static_cast<long long>(p) * h + c * 8)));
  }
  fin_store(acc, t, c, h, out);
}

// A small call's token (finalize_kernel<true> where each thread holds one 16-byte chunk, top_k
// <= kFinBatch and a warp per route): one round trip of GEMM2's data after the wait instead of
// three. The positions and weights are read before griddepcontrol.wait (pos_of_route's writer,
// route_kernel or GEMM1, completed before any GEMM2 block passed its wait, and this grid launches
// only after every GEMM2 block has triggered or exited; through L2, never an L1 line of an earlier
// call); after it, each thread's z chunks of the owned routes and warp j's partial sums of route
// j are in flight together. The same sums in the same order as finalize_coefs +
// finalize_chunk_batched, so the same bits. finalize's work after its wait is on a decode call's
// critical path (~1 us for the coefficients and ~1 us for the z chunks at M = 1, H200); against
// the three-trip form: M = 1 0.988-0.991x, 2 0.987-0.999x, 4 0.994-0.996x, 8-256 neutral.
__device__ __forceinline__ void finalize_one_trip(const int t, const int* __restrict__ pos_of_route,
                                                  const float* __restrict__ topk_weights,
                                                  const int top_k, const uint16_t* __restrict__ z,
                                                  const float* __restrict__ partial,
                                                  const int nparts, const int pcap, const int h,
                                                  const int rms_norm, uint16_t* __restrict__ out,
                                                  float* coef) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = threadIdx.x;  // this thread's chunk (h / 8 <= blockDim.x)
  const long long r0 = static_cast<long long>(t) * top_k;
  int p[kFinBatch];
#pragma unroll
  for (int u = 0; u < kFinBatch; ++u) p[u] = u < top_k ? __ldcg(pos_of_route + r0 + u) : -1;
  const int pw = warp < top_k ? __ldcg(pos_of_route + r0 + warp) : -1;
  const float ww = warp < top_k ? topk_weights[r0 + warp] : 0.0f;
  pdl_wait();
  uint4 v[kFinBatch];
#pragma unroll
  for (int u = 0; u < kFinBatch; ++u)
    v[u] = p[u] >= 0 && c < h / 8
               ? __ldcg(reinterpret_cast<const uint4*>(z + static_cast<long long>(p[u]) * h + c * 8))
               : make_uint4(0u, 0u, 0u, 0u);
  if (warp < top_k) {
    const float sw = route_sq_sum(pw, partial, nparts, pcap, lane);
    if (lane == 0) coef[warp] = route_coef(pw, ww, sw, h, rms_norm);
  }
  __syncthreads();
  if (c >= h / 8) return;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int u = 0; u < kFinBatch; ++u)
    if (p[u] >= 0) fin_accumulate(acc, coef[u], v[u]);
  fin_store(acc, t, c, h, out);
}

// One block per token; H / 8 16-byte chunks spread over the threads. BATCHED (calls of fewer than
// kFinBatchedMaxTokens tokens): a token's route loads issued together, H / 8 threads (at most
// 512); otherwise one route after another on 256 threads (fin_threads).
template <bool BATCHED>
__global__ void finalize_kernel(const int* __restrict__ pos_of_route,
                                const float* __restrict__ topk_weights, int top_k,
                                const uint16_t* __restrict__ z, const float* __restrict__ partial,
                                int nparts, int pcap, int h, int rms_norm,
                                uint16_t* __restrict__ out) {
  extern __shared__ float fsm[];
  float* coef = fsm;
  int* pos = reinterpret_cast<int*>(fsm + top_k);
  const int t = blockIdx.x;
  if (BATCHED && top_k <= kFinBatch && top_k <= static_cast<int>(blockDim.x >> 5) &&
      h / 8 <= static_cast<int>(blockDim.x)) {
    finalize_one_trip(t, pos_of_route, topk_weights, top_k, z, partial, nparts, pcap, h, rms_norm,
                      out, coef);
    return;
  }
  pdl_wait();
  finalize_coefs(t, pos_of_route, topk_weights, top_k, partial, nparts, pcap, h, rms_norm, coef,
                 pos);
  for (int c = threadIdx.x; c < h / 8; c += blockDim.x) {
    if constexpr (BATCHED)
      finalize_chunk_batched(t, c, top_k, coef, pos, z, h, out);
    else
      finalize_chunk(t, c, top_k, coef, pos, z, h, out);
  }
}


// ------------------------------------ host side ----------------------------------------------

thread_local char g_error[512] = "";

int fail(int code, const char* msg) {
  snprintf(g_error, sizeof(g_error), "%s", msg);
  return code;
}

int check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "%s: %s", what, cudaGetErrorString(err));
    return 2;
  }
  return 0;
}

// Every kernel is launched with programmatic dependent launch: its blocks are scheduled while the
// previous kernel on the stream finishes, and each waits for it (pdl_wait) before touching its
// outputs (1.5-2.5 us per call on the H200). CUDA graphs capture it as programmatic edges.
template <typename Kernel, typename... Args>
int launch(const char* what, Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
           Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "%s: %s", what, cudaGetErrorString(err));
    return 2;
  }
  return check_launch(what);
}

// The two GEMMs of a call, GEMM2 chained behind GEMM1 (names: the kernels, for errors).
template <typename K1, typename K2>
int launch_gemm_pair(const char* what1, K1 k1, dim3 grid1, int threads1, int smem1,
                     const char* what2, K2 k2, dim3 grid2, int threads2, int smem2,
                     const GemmArgs& g1, const GemmArgs& g2, cudaStream_t stream) {
  if (int rc = launch(what1, k1, grid1, dim3(threads1), smem1, stream, g1)) return rc;
  return launch(what2, k2, grid2, dim3(threads2), smem2, stream, g2);
}

// ----------------------------- call-size thresholds (H200 measurements) ------------------------
// Ratios are times against the alternative named, timed in alternating runs of CUDA-graph
// replays (benchmarks/kernel.py's method), routes = M top_k.

// route_kernel's block: 256 threads for calls of <= kRouteSmallMaxRoutes routes (fewer warps at
// each barrier), else 1024 (256 / 1024 threads: M = 1 0.981, 2 0.989, 4 0.998, 8-128 1.00).
constexpr long long kRouteSmallMaxRoutes = 64;
// Calls of at least kRouteMultiMinRoutes routes (M = 2048 at top-8) are routed by
// route_count_kernel + route_scatter_kernel (one block per 4096 routes): route_kernel's one block
// measured 1.008 of them at M = 2048, 1.015-1.019 at 4096-16384, 0.999 at 1024.
constexpr long long kRouteMultiMinRoutes = 16384;
// finalize loads a token's routes together below kFinBatchedMaxTokens tokens (one thread per
// 16-byte chunk: H / 8 threads, at most 512; serial / batched 1.007-1.012 at M = 1-256); larger
// calls keep the route loop on 256 threads: a latency-bound grid of thousands of blocks wants 8
// resident blocks per SM, and the batched kernel (64 registers x 512 threads) gets 2 (batched /
// serial: M = 1024 1.015, 2048 1.022, 4096-16384 1.03-1.035).
constexpr long long kFinBatchedMaxTokens = 512;
// v6 grid rows (grid_rows): kCapRows rows for calls of <= kCapMaxRoutes routes (M <= 8 at top-8;
// t_max is 9-40 rows there for ~1-7 tiles), blocks looping over tiles; one row per possible tile
// (t_max) above. M = 1: 2 rows 0.97 of the full grid; 1, 3, 4 rows 1.06, 1.049, 1.097 of 2 rows;
// M = 2-8: 2 rows 0.98-1.0 of 4 rows (to 32 routes) / 6 rows (to 64); at M = 16 6 rows measured
// 1.069 of the full grid.
constexpr int kCapRows = 2;
constexpr long long kCapMaxRoutes = 64;
// Capped calls of <= kCapTwoMaxRoutes routes (M = 1) run the loop kernels compiled for 2 blocks
// per SM (70-100 registers); larger capped calls the ones with the one-tile grid's occupancy
// (loop_mb), and GEMM2 spread over the SMs when GEMM1 routed the call (moe_gemm_spread_kernel;
// against the (n-blocks, rows) grid: M = 2 0.991-0.993, 4 0.995-1.005, 8 0.987-0.991; at M = 1
// 1.006-1.011, so M = 1 keeps the grid).
constexpr long long kCapTwoMaxRoutes = 8;
constexpr int kTwoMb = 2;
template <typename G>
constexpr int loop_mb() {
  return 32 / (G::NW * G::NK) > 2 ? 32 / (G::NW * G::NK) : 2;
}
// One-tile v6 grids on fewer rows than t_max (one_tile_rows, moe_gemm_kernel<..., OVF>): GEMM2
// from kOvfG2MinRoutes routes, GEMM1 from kOvfG1MinRoutes (M = 64 / 128 at top-8), on
// R = ceil(2 L / 8) + min(2 L, El) rows for L the local routes uniform routing expects. Against
// the full grids (same bits): GEMM2 alone M = 32 0.998, 64 0.997, 96 0.985, 128 0.973; GEMM1 alone
// 1.008, 1.018, 0.998, 0.986; both at M = 128 0.959-0.966.
constexpr long long kOvfG2MinRoutes = 512;
constexpr long long kOvfG1MinRoutes = 1024;
constexpr long long kOvfFactor = 2;
constexpr long long kNoMaxRoutes = LLONG_MAX;

// ------------------------------------ compiled configurations -----------------------------------
// Only these are compiled, and each is picked by expertd_moe_forward for the calls named:
//   BT = the caller's bt, or expertd_pick_bt(M, top_k, E, H, I);
//   BT 8: v6 (mma.sync): V6Tiny, V6Mid or V6Large by the call's routes where H and I are
//         multiples of 512, else V6Bk256 (with_v6_config), on the grid form its routes take
//         (launch_v6);
//   BT 16, 32, 48, 64, 96, 128, 144, 160: v8 (wgmma), the V8Bt<BT> configuration.

// One v6 GEMM: WM m-tiles (16 weight rows) per warp, NW warps along rows, NK warps splitting each
// stage's k-groups (split-K inside the block), KG 64-k groups per stage, ST pipeline stages.
template <int WM_, int NW_, int NK_, int KG_, int ST_>
struct V6Gemm {
  static constexpr int WM = WM_, NW = NW_, NK = NK_, KG = KG_, ST = ST_;
  using Shape = GemmShape<8, WM, NW, NK, KG, ST>;
};
// A v6 configuration: its two GEMMs and the routes per call it is picked for; the grid forms
// those calls can take (and so the kernel instances compiled) follow from the route range.
constexpr int kV6Bt = 8;
constexpr int kV6G2Rows = 32;  // GEMM2 rows per block of every v6 configuration (nparts)
template <typename G1_, typename G2_, long long MIN_ROUTES, long long MAX_ROUTES>
struct V6Config {
  using G1 = G1_;
  using G2 = G2_;
  static constexpr long long kMinRoutes = MIN_ROUTES, kMaxRoutes = MAX_ROUTES;
  static constexpr bool kCapped = kMinRoutes <= kCapMaxRoutes;  // capped (looping) grids
  static constexpr bool kCappedTwo = kCapped && kMinRoutes <= kCapTwoMaxRoutes;
  static constexpr bool kCappedWide = kCapped && kMaxRoutes > kCapTwoMaxRoutes;
  static constexpr bool kOvf1 = kMaxRoutes >= kOvfG1MinRoutes;
  static constexpr bool kOvf2 = kMaxRoutes >= kOvfG2MinRoutes;
  // The partial sums of z^2 are laid out per GEMM2 block (Plan::nparts), the same for every v6
  // configuration so that the workspace and finalize need not know which one ran.
  static_assert(16 * G2::WM * G2::NW == kV6G2Rows, "v6 GEMM2 blocks of 32 rows");
};

// v6 at BT 8 (decode, lambda <= 4). Where H and I are multiples of 512, stages of KG 8 (BK 512;
// 4 in V6Large's GEMM1) split over the k-warps so that each warp takes 2-4 k-groups per stage:
// the per-stage overhead (ring slot, copies, barrier: ~45 of the 113 instructions of a
// one-k-group stage) is paid once per 2-4 k-groups. V6Config<GEMM1, GEMM2, routes from, to>,
// V6Gemm<WM, NW, NK, KG, ST>:
// Calls of <= 8 routes (M = 1): 16-row GEMM1 blocks of 4 warps, 4 stages (52 KB: 4 blocks per SM,
// M = 1's 512 GEMM1 blocks in one wave): 0.96 of V6Mid's shape at M = 1 (32 input sets), 1.04-1.09
// at M = 2-8.
using V6Tiny = V6Config<V6Gemm<1, 1, 4, 8, 4>, V6Gemm<1, 2, 4, 8, 3>, 1, kCapTwoMaxRoutes>;
// 9-127 routes: 32-row GEMM1 blocks (finer work units for the last wave at M = 2-16): against
// 64-row blocks of 16 warps (split-K over 8 warps at M <= 2) M = 1 0.965, 2 0.988, 4 0.986, 8
// 0.978; 16-row GEMM1 blocks 1.07-1.12 from M = 3.
using V6Mid = V6Config<V6Gemm<1, 2, 4, 8, 3>, V6Gemm<1, 2, 4, 8, 3>, kCapTwoMaxRoutes + 1, 127>;
// From 128 routes: GEMM1 stages half as deep in k with 2 k-warps (27 KB, 48-60 registers: 8
// blocks of 4 warps per SM), GEMM2 4 k-groups per warp: against KG 8 GEMM1 stages M = 16 0.984,
// 32 0.967, 64 0.958 (1.01-1.11 below 128 routes).
using V6Large = V6Config<V6Gemm<1, 2, 2, 4, 3>, V6Gemm<1, 2, 2, 8, 3>, 128, kNoMaxRoutes>;
// Any call where H or I is not a multiple of 512 (BK 256): 16 warps per block, two blocks per SM,
// the 6-stage ring deep enough for the H200's latency (one block per SM with a deeper ring: 1.3-
// 1.45x from M = 2).
using V6Bk256 = V6Config<V6Gemm<1, 4, 4, 4, 6>, V6Gemm<1, 2, 4, 4, 6>, 1, kNoMaxRoutes>;
// Measured and not compiled: split-K over 8 warps of 32-row blocks (5% faster at M = 1-2, 3-4%
// slower from M = 4); one block per SM with 8-11 stages in flight (3-25% slower); 32-warp GEMM1
// blocks (1-24% slower); warp-private blocks (1.03-1.21).

template <typename Fn>
void for_each_v6_config(Fn&& fn) {
  fn(V6Tiny{});
  fn(V6Mid{});
  fn(V6Large{});
  fn(V6Bk256{});
}
// Whether v6 runs a call of these widths in its BK 256 configuration (the tile pick avoids it).
inline bool v6_bk256(int h, int inter) { return h % 512 || inter % 512; }
// fn(C{}) for the v6 configuration of a call.
template <typename Fn>
auto with_v6_config(long long routes, int h, int inter, Fn&& fn) {
  if (v6_bk256(h, inter)) return fn(V6Bk256{});
  if (routes <= V6Tiny::kMaxRoutes) return fn(V6Tiny{});
  if (routes <= V6Mid::kMaxRoutes) return fn(V6Mid{});
  return fn(V6Large{});
}

// One v8 GEMM: NWG warpgroups per block, WM 64-row slabs per warpgroup (each warp holds one
// 16-row m-tile of each slab: WM wgmmas per k-step, one token tile in shared memory for
// 64 NWG WM weight rows), KG 64-k groups per stage, ST stages, MB blocks per SM asked of ptxas
// (__launch_bounds__: registers <= 64K / (MB x threads)). Whole K per warp (no split-K).
template <int NWG_, int WM_, int KG_, int ST_, int MB_>
struct V8Gemm {
  static constexpr int NWG = NWG_, WM = WM_, KG = KG_, ST = ST_, MB = MB_;
  static constexpr int kRows = 64 * NWG * WM;
};
// A v8 configuration: the tile size, its two GEMMs and the ring (v8_tile's RING).
template <int BT, typename G1_, typename G2_, int RING>
struct V8Config {
  static constexpr int kBt = BT, kRing = RING;
  using G1 = G1_;
  using G2 = G2_;
  using Sh1 = WgShape<BT, G1::NWG, G1::WM, G1::KG, G1::ST, G1::MB>;
  using Sh2 = WgShape<BT, G2::NWG, G2::WM, G2::KG, G2::ST, G2::MB>;
};

// v8 (wgmma) from BT 16: the tokens of a tile are wgmma's N (BT, trimmed to the tile's routes:
// v8_dispatch), read from shared memory through a descriptor; the dequantized weights its A
// operand, straight from registers. Both GEMMs of a tile size share one shape.
//   BT | NWG WM KG ST MB | ring | smem per block, registers, why
//   16 |   2  1  2  5  2 |   2  |  71 KB, 70-72: 3 blocks per SM (M = 129-400): 0.944-0.964 of
//      |                 |      |   KG 4 / 3 stages at 2 blocks per SM at M = 160-320, 0.973-0.989
//      |                 |      |   at 384; KG 2 / 6 stages 0.985-1.01
//   32 |   2  1  2  4  3 |   2  |  73 KB, 75-80: 3 blocks per SM (M = 401-864), GEMM2's only with
//      |                 |      |   the 896-byte pad (kAlignPad): GEMM1 0.965-1.011 (most near
//      |                 |      |   0.98) of KG 4 / 3 stages / 2 blocks, then GEMM2 0.974-0.999
//   48 |   2  1  2  4  2 |   3  |  89 KB
//   64 |   2  1  2  4  2 |   2  | 105 KB
//   96 |   4  1  2  4  1 |   3  | 177 KB: from BT 96, 256 weight rows share one token tile (half
//  128 |   4  1  1  6  1 |   3  | 157 KB  the tokens' L2 -> SM traffic), 1 block per SM, 98-128
//  144 |   4  1  1  6  1 |   3  | 169 KB  registers; against 2 x 128 rows at 2 blocks per SM: BT
//  160 |   4  1  1  6  1 |   3  | 181 KB  96 0.90-0.95 at M = 1984-2240, 128 0.97-0.98 at 3072 /
//      |                 |      |   6144, 144 0.935-0.977 at 8192 / 16384, 160 0.988 at 4096 (BT
//      |                 |      |   48 / 64 so: 1.0-1.07); BT 128 / 144 at KG 2 spill
// Rings (v8_tile), ring 3 / ring 2: BT 48 at M = 1024 0.984-0.997; from BT 96 at M = 2048 0.93,
// 3072-16384 0.98-0.99 (ring 2 / ring 3 at BT 96 / 160: 1.05-1.07 / 1.09, and the unrolled ring 2
// spills there); ring 2 stays at BT 16 / 32 (ring 3 / ring 2 1.02 / 1.00-1.14) and BT 64 (1.006-
// 1.017 at M = 1280, 0.95-1.065 at 1408-1792).
// Measured and not compiled: 256 weight rows per token tile at BT 32 / 48; KG 2 / ST 4 with 3
// blocks per SM at BT 32 (2-5% slower at M = 128-512); KG 1 / ST 5-6 with 3-4 blocks per SM at BT
// 32 and 48 (5-23% slower at M = 128-1024: with 16 warps per SM the tensor pipe is 42-52% and
// 43-55% of the issue slots busy at M = 1024, more warps do not help); BT 96 with KG 1 / ST 5 (1.06 at M =
// 2048); v6 at BT 16-64 and at BT 24 (v8 is faster wherever those tile sizes are picked).
using V8Bt16 = V8Config<16, V8Gemm<2, 1, 2, 5, 2>, V8Gemm<2, 1, 2, 5, 2>, 2>;
using V8Bt32 = V8Config<32, V8Gemm<2, 1, 2, 4, 3>, V8Gemm<2, 1, 2, 4, 3>, 2>;
using V8Bt48 = V8Config<48, V8Gemm<2, 1, 2, 4, 2>, V8Gemm<2, 1, 2, 4, 2>, 3>;
using V8Bt64 = V8Config<64, V8Gemm<2, 1, 2, 4, 2>, V8Gemm<2, 1, 2, 4, 2>, 2>;
using V8Bt96 = V8Config<96, V8Gemm<4, 1, 2, 4, 1>, V8Gemm<4, 1, 2, 4, 1>, 3>;
using V8Bt128 = V8Config<128, V8Gemm<4, 1, 1, 6, 1>, V8Gemm<4, 1, 1, 6, 1>, 3>;
using V8Bt144 = V8Config<144, V8Gemm<4, 1, 1, 6, 1>, V8Gemm<4, 1, 1, 6, 1>, 3>;
using V8Bt160 = V8Config<160, V8Gemm<4, 1, 1, 6, 1>, V8Gemm<4, 1, 1, 6, 1>, 3>;

template <typename Fn>
void for_each_v8_config(Fn&& fn) {
  fn(V8Bt16{});
  fn(V8Bt32{});
  fn(V8Bt48{});
  fn(V8Bt64{});
  fn(V8Bt96{});
  fn(V8Bt128{});
  fn(V8Bt144{});
  fn(V8Bt160{});
}
// fn(C{}) for the v8 configuration of tile size bt; false when bt has none.
template <typename Fn>
bool with_v8_config(int bt, Fn&& fn) {
  bool found = false;
  for_each_v8_config([&](auto c) {
    if (decltype(c)::kBt == bt) {
      found = true;
      fn(c);
    }
  });
  return found;
}

// The GEMM path of tile size bt: 6 (mma.sync) at BT 8, 8 (wgmma) where kV8Configs has it, else
// 0 (not a compiled tile size).
int kernel_path(int bt) {
  if (bt == kV6Bt) return 6;
  return with_v8_config(bt, [](auto) {}) ? 8 : 0;
}
int g2_rows_for(int bt) {
  int rows = bt == kV6Bt ? kV6G2Rows : 0;
  with_v8_config(bt, [&](auto c) { rows = decltype(c)::G2::kRows; });
  return rows;
}

// ------------------------------------ plan and workspace ----------------------------------------

struct Plan {
  int bt;
  int path;  // 6 (mma.sync) or 8 (wgmma)
  int t_max;  // tiles a call can have: routes / BT + min(routes, El)
  int pcap;  // positions: t_max BT
  int nparts;  // GEMM2 n-blocks = H / rows per block
};

Plan make_plan(long long m, int top_k, int h, int el, int bt) {
  Plan p;
  p.path = kernel_path(bt);
  const long long routes = m * top_k;
  p.bt = bt;
  p.t_max = static_cast<int>(routes / bt + (routes < el ? routes : el));
  p.pcap = p.t_max * bt;
  p.nparts = h / g2_rows_for(bt);
  return p;
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

constexpr int kSlotsWords = kSlotsOff + kMaxSlots;  // num_tiles, then the spread slot counters

struct Carve {
  int* num_tiles;
  int* tile_expert;
  int* sorted_route;
  int* pos_of_route;
  uint16_t* act;
  uint16_t* z;
  float* partial;
  int* route_hist;  // route_count_kernel's counts: [ceil(routes / kRouteChunk)][El]
  size_t bytes;
};

Carve carve(uint8_t* base, const Plan& p, long long m, int top_k, int h, int inter, int el) {
  Carve c;
  size_t o = 0;
  auto take = [&](size_t bytes) {
    uint8_t* ptr = base ? base + o : nullptr;
    o += align256(bytes);
    return ptr;
  };
  c.num_tiles = reinterpret_cast<int*>(take(sizeof(int) * kSlotsWords));
  c.tile_expert = reinterpret_cast<int*>(take(sizeof(int) * (p.t_max + 1)));
  c.sorted_route = reinterpret_cast<int*>(take(sizeof(int) * (p.pcap + 1)));
  c.pos_of_route = reinterpret_cast<int*>(take(sizeof(int) * (m * top_k + 1)));
  c.act = reinterpret_cast<uint16_t*>(take(sizeof(uint16_t) * (static_cast<size_t>(p.pcap) * inter + 8)));
  c.z = reinterpret_cast<uint16_t*>(take(sizeof(uint16_t) * (static_cast<size_t>(p.pcap) * h + 8)));
  c.partial = reinterpret_cast<float*>(take(sizeof(float) * (static_cast<size_t>(p.nparts) * p.pcap + 1)));
  c.route_hist = reinterpret_cast<int*>(
      take(sizeof(int) * (static_cast<size_t>((m * top_k + kRouteChunk - 1) / kRouteChunk) * el + 1)));
  c.bytes = o;
  return c;
}

int fin_threads_for(int h) {
  const int t = (h / 8 + 31) / 32 * 32;
  return t < 32 ? 32 : (t > 512 ? 512 : t);
}

// ------------------------------------ v6 launches -----------------------------------------------

// v6 grid rows: kCapRows for calls of <= kCapMaxRoutes routes, else t_max (one per tile).
int grid_rows(int t_max, long long routes) {
  const int cap = routes <= kCapMaxRoutes ? kCapRows : 0;
  return cap > 0 && cap < t_max ? cap : t_max;
}
// Whether GEMM1 routes the call itself (moe_gemm_self_kernel): v6 on a capped grid (rows < t_max,
// so at most kCapMaxRoutes <= kSelfMaxRoutes routes) and at most kSelfMaxExperts local experts.
static_assert(kCapMaxRoutes <= kSelfMaxRoutes, "a capped call fits moe_gemm_self_kernel's tables");
bool use_self_route(int path, int el, int rows, int t_max) {
  return path == 6 && el <= kSelfMaxExperts && rows < t_max;
}

// Rows of the one-tile v6 grids (moe_gemm_kernel<..., OVF>): t_max (every tile the call could
// have, all routes local) or R = min(t_max, ceil(F L / BT) + min(F L, El)), L the local routes
// uniform routing expects, F = kOvfFactor: the tiles past R run on the rows' blocks in turn.
struct OneTileRows {
  int g1, g2;
};
OneTileRows one_tile_rows(int t_max, long long routes, int el, int num_experts) {
  const long long f = kOvfFactor, bt = kV6Bt;
  const long long local = num_experts > el ? (routes * el + num_experts - 1) / num_experts : routes;
  const long long hit = f * local < el ? f * local : el;  // experts with a route, at most
  const long long bound = (f * local + bt - 1) / bt + hit;
  const int r = bound >= 1 && bound < t_max ? static_cast<int>(bound) : t_max;  // 0: no experts
  return {routes >= kOvfG1MinRoutes ? r : t_max, routes >= kOvfG2MinRoutes ? r : t_max};
}

// The v6 kernel instances of a GEMM G.
template <typename G, bool GATED, bool OVF>
auto one_tile_kernel() {
  return moe_gemm_kernel<kV6Bt, G::WM, G::NW, G::NK, G::KG, G::ST, GATED, OVF>;
}
template <typename G, bool GATED, int MB>
auto loop_kernel() {
  return moe_gemm_loop_kernel<kV6Bt, G::WM, G::NW, G::NK, G::KG, G::ST, GATED, MB>;
}
template <typename G, int MB>
auto self_kernel() {
  return moe_gemm_self_kernel<kV6Bt, G::WM, G::NW, G::NK, G::KG, G::ST, MB>;
}
template <typename G, int MB>
auto spread_kernel() {
  return moe_gemm_spread_kernel<kV6Bt, G::WM, G::NW, G::NK, G::KG, G::ST, MB>;
}

// The launch of GEMM2 at decode (moe_gemm_spread_kernel): grid and spread_sms.
struct SpreadLaunch {
  dim3 grid;
  int spread_sms;
};
// P blocks on each of the S SMs, P the blocks an SM holds at once; spread_sms = 0 (the caller
// launches the (n-blocks, rows) grid, which computes the same) where the device or the kernel
// do not allow it.
template <typename Kernel>
SpreadLaunch spread_launch_query(Kernel kernel, int dev, int threads, int smem) {
  const SpreadLaunch plain{dim3(1), 0};
  int sms = 0, fits = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms > kMaxSlots ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, kernel, threads, smem) != cudaSuccess ||
      fits < 1) {
    cudaGetLastError();
    return plain;
  }
  return SpreadLaunch{dim3(static_cast<unsigned>(fits * sms)), sms};
}
// spread_launch_query's answer per (device, kernel, threads, shared memory), kept for the
// library's lifetime: what it reads does not change, and the queries cost host time on every
// eager call at M = 2-8 (graph replays skip the host code).
struct SpreadCacheEntry {
  int dev;
  const void* kernel;
  int threads, smem;
  SpreadLaunch launch;
};
constexpr int kSpreadCacheSize = 64;
template <typename Kernel>
SpreadLaunch spread_launch(Kernel kernel, int threads, int smem) {
  static std::mutex mu;
  static SpreadCacheEntry cache[kSpreadCacheSize];
  static int cached = 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return SpreadLaunch{dim3(1), 0};
  }
  const void* key = reinterpret_cast<const void*>(kernel);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < cached; ++i) {
      const SpreadCacheEntry& c = cache[i];
      if (c.dev == dev && c.kernel == key && c.threads == threads && c.smem == smem)
        return c.launch;
    }
  }
  const SpreadLaunch l = spread_launch_query(kernel, dev, threads, smem);
  std::lock_guard<std::mutex> lock(mu);
  if (cached < kSpreadCacheSize) cache[cached++] = SpreadCacheEntry{dev, key, threads, smem, l};
  return l;
}

// The capped grid (n-blocks, rows < t_max): GEMM1 routing the call itself (self) or the loop
// kernel; GEMM2 spread over the SMs (SPREAD, when GEMM1 routed the call) or the loop kernel.
template <typename C, int MB1, int MB2, bool SPREAD>
int launch_v6_capped(const GemmArgs& g1, const GemmArgs& g2, int nx1, int nx2, int rows,
                     const SelfRoute* self, cudaStream_t stream) {
  using Sh1 = typename C::G1::Shape;
  using Sh2 = typename C::G2::Shape;
  const dim3 grid1(nx1, rows), block1(Sh1::kThreads);
  const int rc = self ? launch("moe_gemm self (gate/up)", self_kernel<typename C::G1, MB1>(), grid1,
                               block1, Sh1::kSmemBytes, stream, g1, *self)
                      : launch("moe_gemm loop (gate/up)",
                               loop_kernel<typename C::G1, true, MB1>(), grid1, block1,
                               Sh1::kSmemBytes, stream, g1);
  if (rc) return rc;
  if constexpr (SPREAD) {
    if (self) {
      const auto k2 = spread_kernel<typename C::G2, MB2>();
      const SpreadLaunch l2 = spread_launch(k2, Sh2::kThreads, Sh2::kSmemBytes);
      if (l2.spread_sms > 0)
        return launch("moe_gemm spread (down)", k2, l2.grid, dim3(Sh2::kThreads), Sh2::kSmemBytes,
                      stream, g2, l2.spread_sms);
    }
  }
  return launch("moe_gemm loop (down)", loop_kernel<typename C::G2, false, MB2>(),
                dim3(nx2, rows), dim3(Sh2::kThreads), Sh2::kSmemBytes, stream, g2);
}

// The v6 GEMMs of a call with configuration C on `rows` grid rows (grid_rows); self: GEMM1 routes
// the call (use_self_route).
template <typename C>
int launch_v6(const GemmArgs& g1, const GemmArgs& g2, int t_max, int rows, long long routes,
              int h, int inter, int el, int num_experts, const SelfRoute* self,
              cudaStream_t stream) {
  using Sh1 = typename C::G1::Shape;
  using Sh2 = typename C::G2::Shape;
  if (t_max == 0) return 0;
  if (h % Sh1::kBK || inter % Sh2::kBK)
    return fail(1, "H and I must be multiples of the GEMMs' k-stage (64 KG)");
  // n-blocks along x (dispatched first): the blocks of one tile spread over the SMs, so one hit
  // expert still fills the chip (tiles along x put 2 busy blocks on some SMs, none on others).
  const int nx1 = (2 * inter / 16) / Sh1::kMTiles, nx2 = (h / 16) / Sh2::kMTiles;
  if (t_max > 65535) return fail(1, "too many tiles for grid.y: split the call");
  if (rows < t_max) {
    if constexpr (C::kCappedTwo) {
      if (routes <= kCapTwoMaxRoutes)
        return launch_v6_capped<C, kTwoMb, kTwoMb, false>(g1, g2, nx1, nx2, rows, self, stream);
    }
    if constexpr (C::kCappedWide) {
      if (routes > kCapTwoMaxRoutes)
        return launch_v6_capped<C, loop_mb<typename C::G1>(), loop_mb<typename C::G2>(), true>(
            g1, g2, nx1, nx2, rows, self, stream);
    }
  }
  auto k1 = one_tile_kernel<typename C::G1, true, false>();
  auto k2 = one_tile_kernel<typename C::G2, false, false>();
  int rows1 = t_max, rows2 = t_max;
  const OneTileRows ovf = one_tile_rows(t_max, routes, el, num_experts);
  if constexpr (C::kOvf1) {
    if (ovf.g1 < t_max) {
      k1 = one_tile_kernel<typename C::G1, true, true>();
      rows1 = ovf.g1;
    }
  }
  if constexpr (C::kOvf2) {
    if (ovf.g2 < t_max) {
      k2 = one_tile_kernel<typename C::G2, false, true>();
      rows2 = ovf.g2;
    }
  }
  return launch_gemm_pair("moe_gemm (gate/up)", k1, dim3(nx1, rows1), Sh1::kThreads,
                          Sh1::kSmemBytes, "moe_gemm (down)", k2, dim3(nx2, rows2),
                          Sh2::kThreads, Sh2::kSmemBytes, g1, g2, stream);
}

template <typename Kernel>
bool set_max_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) ==
         cudaSuccess;
}

// The dynamic shared-memory limit of every kernel instance launch_v6 can pick for C.
template <typename C>
int set_smem_attrs_v6() {
  using G1 = typename C::G1;
  using G2 = typename C::G2;
  constexpr int s1 = G1::Shape::kSmemBytes, s2 = G2::Shape::kSmemBytes;
  bool ok = set_max_smem(one_tile_kernel<G1, true, false>(), s1) &&
            set_max_smem(one_tile_kernel<G2, false, false>(), s2);
  if constexpr (C::kOvf1) ok = ok && set_max_smem(one_tile_kernel<G1, true, true>(), s1);
  if constexpr (C::kOvf2) ok = ok && set_max_smem(one_tile_kernel<G2, false, true>(), s2);
  if constexpr (C::kCappedTwo)
    ok = ok && set_max_smem(self_kernel<G1, kTwoMb>(), s1) &&
         set_max_smem(loop_kernel<G1, true, kTwoMb>(), s1) &&
         set_max_smem(loop_kernel<G2, false, kTwoMb>(), s2);
  if constexpr (C::kCappedWide)
    ok = ok && set_max_smem(self_kernel<G1, loop_mb<G1>()>(), s1) &&
         set_max_smem(loop_kernel<G1, true, loop_mb<G1>()>(), s1) &&
         set_max_smem(loop_kernel<G2, false, loop_mb<G2>()>(), s2) &&
         set_max_smem(spread_kernel<G2, loop_mb<G2>()>(), s2);
  return ok ? 0 : check_launch("cudaFuncSetAttribute (v6)");
}

// ------------------------------------ v8 launches -----------------------------------------------

template <typename C, bool GATED>
auto v8_kernel() {
  using G = std::conditional_t<GATED, typename C::G1, typename C::G2>;
  return moe_gemm_v8_kernel<C::kBt, G::NWG, G::WM, G::KG, G::ST, G::MB, GATED, C::kRing>;
}

// Both v8 GEMMs of a call with configuration C: grid (n-blocks, t_max); blocks past num_tiles exit.
template <typename C>
int launch_v8(const GemmArgs& g1, const GemmArgs& g2, int t_max, int h, int inter,
              cudaStream_t stream) {
  using Sh1 = typename C::Sh1;
  using Sh2 = typename C::Sh2;
  if (t_max == 0) return 0;
  if (h % Sh1::kBK || inter % Sh2::kBK)
    return fail(1, "H and I must be multiples of the GEMMs' k-stage (64 KG)");
  const int mt1 = 2 * inter / 16, mt2 = h / 16;
  if (mt1 % Sh1::kMTiles || mt2 % Sh2::kMTiles)
    return fail(1, "2I and H must be multiples of the v8 GEMMs' rows per block");
  if (t_max > 65535) return fail(1, "too many tiles for grid.y: split the call");
  return launch_gemm_pair("moe_gemm_v8 (gate/up)", v8_kernel<C, true>(),
                          dim3(mt1 / Sh1::kMTiles, t_max), Sh1::kThreads, Sh1::kSmemBytes,
                          "moe_gemm_v8 (down)", v8_kernel<C, false>(),
                          dim3(mt2 / Sh2::kMTiles, t_max), Sh2::kThreads, Sh2::kSmemBytes, g1, g2,
                          stream);
}

// Whether kernel's static shared memory leaves its ring 1024-aligned within Sh::kAlignPad.
template <typename Sh, typename Kernel>
bool align_pad_covers(Kernel kernel) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) return false;
  return static_cast<int>((1024 - fa.sharedSizeBytes % 1024) % 1024) <= Sh::kAlignPad;
}

template <typename C>
int set_smem_attrs_v8() {
  using Sh1 = typename C::Sh1;
  using Sh2 = typename C::Sh2;
  if (!set_max_smem(v8_kernel<C, true>(), Sh1::kSmemBytes) ||
      !set_max_smem(v8_kernel<C, false>(), Sh2::kSmemBytes))
    return check_launch("cudaFuncSetAttribute (v8)");
  if (!align_pad_covers<Sh1>(v8_kernel<C, true>()) ||
      !align_pad_covers<Sh2>(v8_kernel<C, false>()))
    return fail(2, "a v8 kernel's static shared memory needs more alignment pad than "
                   "WgShape::kAlignPad gives");
  return 0;
}

}  // namespace

// ------------------------------------ C ABI --------------------------------------------------

extern "C" {

// Everything one forward needs. Pointers are device pointers; all tensors contiguous.
struct ExpertdMoeArgs {
  const void* x;              // bf16 [m, h]
  const int* topk_ids;        // int32 [m, top_k], global ids or -1
  const float* topk_weights;  // fp32 [m, top_k]
  void* out;                  // bf16 [m, h]
  const int* local_of;        // int32 [num_experts + 1]
  const void* w13_codes;      // repacked, see header
  const void* w13_scales;
  const float* w13_gscale;    // fp32 [el][2]
  const void* w2_codes;
  const void* w2_scales;
  const float* w2_gscale;     // fp32 [el]
  const void* norm_weight;    // bf16 [h]
  void* workspace;
  long long workspace_bytes;
  long long m;
  int top_k;
  int h;
  int inter;
  int num_experts;
  int el;
  int bt;                     // 0: expertd_pick_bt
  void* stream;               // cudaStream_t
  int local_first;            // >= 0: the shard owns ids local_first .. + el - 1; -1: local_of
  int rms_norm;               // 1: the post-expert RMS norm (muse-spark); 0: out = sum w_j z_j
};

const char* expertd_last_error(void) { return g_error; }

// The GEMM path of a call with tile size bt: 6 (mma.sync), 8 (wgmma), 0 (bt not compiled).
int expertd_kernel_path(int bt) { return kernel_path(bt); }

// Tokens per tile for a call, from lambda = M top_k / E, the mean routes per expert (H200 BT
// sweeps of benchmarks/kernel.py, muse-spark shapes, each tile size against the pick):
//   BT 8 (v6) to lambda = 4 (M = 128 at top-8 of 256): against v8's BT 16 M = 96 0.925, 128
//     0.959, 192 1.084.
//   BT 16 to lambda = 12.5: the wgmma half as wide where tiles hold ~4-12 routes (M = 128-256
//     0.87 of BT 32 untrimmed, 384 0.95 of BT 32 trimmed; M = 400 0.970-0.976, 416 1.016-1.022;
//     at M = 512 1.19: many experts need two tiles, each dequantizing the weights again).
//   BT 32 to lambda = 27, 48 to 36, 64 to 58: BT 32 / 48 at M = 704 0.857, 768 0.884-0.900, 832
//     0.942, 896 1.008, 960 1.043, 1024 1.233 (BT 32's 16 k-steps per stage beat BT 48's 8 until
//     a quarter of the experts need a second tile); BT 64 / 48 at M = 1152 0.994, 1280 0.951,
//     1408 0.892; BT 64 / 96 at M = 1536 0.883, 1792 0.973, 2048 1.10.
//   Above, every extra tile of an expert re-dequantizes all its weights, so the tile is the one
//     that holds a busy expert (lambda + 2 sqrt(lambda) routes) in the fewest tiles, the smaller
//     on a tie (larger tiles run each tile a few % slower): 96 to lambda ~ 70, 128 at 96 and 192,
//     160 at 128 (one tile where 128 needs two for half the experts: 0.84), 144 at 256-512
//     (0.93-0.98 of 128).
//   Where H or I is not a multiple of 512, BT 8 runs v6's BK 256 configuration (V6Bk256), and
//     v8's BT 16 beats it from lambda = 0.5 (H100, Qwen3-30B-A3B's H 2048, I 768, 128 experts,
//     top-8: BT 16 / BT 8 at M = 4 1.13, 8 0.868, 16 0.988, 32 0.912, 64 0.918).
int expertd_pick_bt(long long m, int top_k, int num_experts, int h, int inter) {
  const double lambda = static_cast<double>(m) * top_k / (num_experts > 0 ? num_experts : 1);
  if (lambda <= 4) return v6_bk256(h, inter) && lambda >= 0.5 ? 16 : 8;
  if (lambda <= 12.5) return 16;
  if (lambda <= 27) return 32;
  if (lambda <= 36) return 48;
  if (lambda <= 58) return 64;
  const double busy = lambda + 2.0 * sqrt(lambda);
  int best = 0;
  long long best_tiles = 0;
  for (int bt : {96, 128, 144, 160}) {
    const long long tiles = static_cast<long long>(ceil(busy / bt));
    if (!best || tiles < best_tiles) {
      best = bt;
      best_tiles = tiles;
    }
  }
  return best;
}

// Workspace for a call with up to m tokens, whatever tile size the call takes.
long long expertd_workspace_bytes(long long m, int top_k, int h, int inter, int el) {
  size_t best = 0;
  auto consider = [&](int bt) {
    const Plan p = make_plan(m, top_k, h, el, bt);
    const Carve c = carve(nullptr, p, m, top_k, h, inter, el);
    if (c.bytes > best) best = c.bytes;
  };
  consider(kV6Bt);
  for_each_v8_config([&](auto c) { consider(decltype(c)::kBt); });
  return static_cast<long long>(best);
}

// Raise the dynamic shared-memory limit of every compiled GEMM (call once per device, outside
// graph capture).
int expertd_init(void) {
  int rc = 0;
  for_each_v6_config([&](auto c) {
    if (!rc) rc = set_smem_attrs_v6<decltype(c)>();
  });
  for_each_v8_config([&](auto c) {
    if (!rc) rc = set_smem_attrs_v8<decltype(c)>();
  });
  return rc;
}

int expertd_moe_forward(const ExpertdMoeArgs* args) {
  const ExpertdMoeArgs& a = *args;
  if (a.m < 0 || a.top_k < 1 || a.el < 1 || a.num_experts < 1)
    return fail(1, "bad sizes: need m >= 0, top_k >= 1, el >= 1, num_experts >= 1");
  if (a.h % 256 || a.inter % 256 || a.h <= 0 || a.inter <= 0)
    return fail(1, "hidden and intermediate sizes must be positive multiples of 256");
  if (a.local_first >= 0 && a.local_first + static_cast<long long>(a.el) > a.num_experts)
    return fail(1, "local_first + el exceeds num_experts");
  if (a.m == 0) return 0;
  const int bt = a.bt ? a.bt : expertd_pick_bt(a.m, a.top_k, a.num_experts, a.h, a.inter);
  const int path = kernel_path(bt);
  if (path == 0)
    return fail(1, "bt is not a compiled tile size (8, 16, 32, 48, 64, 96, 128, 144, 160)");
  if (a.m * a.top_k > (1LL << 30)) return fail(1, "too many routes in one call");
  const Plan p = make_plan(a.m, a.top_k, a.h, a.el, bt);
  // v8 keeps token row offsets in 32 bits.
  if (path == 8 &&
      (a.m * a.h >= (1LL << 31) || static_cast<long long>(p.pcap) * a.inter >= (1LL << 31)))
    return fail(1, "call too large for this tile size: split it");
  const Carve c = carve(static_cast<uint8_t*>(a.workspace), p, a.m, a.top_k, a.h, a.inter, a.el);
  if (static_cast<long long>(c.bytes) > a.workspace_bytes)
    return fail(1, "workspace too small for this call (see expertd_workspace_bytes)");
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const int routes = static_cast<int>(a.m * a.top_k);

  GemmArgs g1{};
  g1.codes = static_cast<const uint4*>(a.w13_codes);
  g1.scales = static_cast<const uint4*>(a.w13_scales);
  g1.act_in = static_cast<const uint16_t*>(a.x);
  g1.sorted_route = c.sorted_route;
  g1.tile_expert = c.tile_expert;
  g1.num_tiles = c.num_tiles;
  g1.gscale = a.w13_gscale;
  g1.out = c.act;
  g1.k = a.h;
  g1.mt = 2 * a.inter / 16;
  g1.top_k = a.top_k;
  g1.pcap = p.pcap;

  GemmArgs g2{};
  g2.codes = static_cast<const uint4*>(a.w2_codes);
  g2.scales = static_cast<const uint4*>(a.w2_scales);
  g2.act_in = c.act;
  g2.sorted_route = c.sorted_route;
  g2.tile_expert = c.tile_expert;
  g2.num_tiles = c.num_tiles;
  g2.gscale = a.w2_gscale;
  g2.norm_weight = static_cast<const uint16_t*>(a.norm_weight);
  g2.out = c.z;
  g2.partial = c.partial;
  g2.k = a.inter;
  g2.mt = a.h / 16;
  g2.top_k = a.top_k;
  g2.pcap = p.pcap;

  const SelfRoute sr{a.topk_ids,     a.local_of,     a.local_first, c.num_tiles,
                     c.tile_expert,  c.sorted_route, c.pos_of_route, routes,
                     a.num_experts,  a.el};
  const int rows = grid_rows(p.t_max, routes);  // v6's grid rows (v8: the full grid)
  const bool self = use_self_route(path, a.el, rows, p.t_max);
  if (self) {
    // no routing kernel: GEMM1's blocks route the call (moe_gemm_self_kernel)
  } else if (routes >= kRouteMultiMinRoutes) {  // two kernels over chunks
    const unsigned blocks = static_cast<unsigned>((routes + kRouteChunk - 1) / kRouteChunk);
    if (int rc = launch("route_count_kernel", route_count_kernel, dim3(blocks),
                        dim3(kRouteThreads), sizeof(int) * a.el, stream, a.topk_ids, routes,
                        a.local_of, a.local_first, a.num_experts, a.el, c.pos_of_route,
                        c.route_hist))
      return rc;
    if (int rc = launch("route_scatter_kernel", route_scatter_kernel, dim3(blocks),
                        dim3(kRouteThreads), sizeof(int) * (4 * a.el + 1), stream, routes, a.el,
                        bt, static_cast<const int*>(c.route_hist), c.sorted_route,
                        c.pos_of_route, c.tile_expert, c.num_tiles))
      return rc;
  } else {
    const bool small = routes <= kRouteSmallMaxRoutes;
    if (int rc = launch("route_kernel", small ? route_kernel<256> : route_kernel<kRouteThreads>,
                        dim3(1), dim3(small ? 256 : kRouteThreads), sizeof(int) * (3 * a.el + 1),
                        stream, a.topk_ids, routes, a.local_of, a.local_first, a.num_experts,
                        a.el, bt, c.sorted_route, c.pos_of_route, c.tile_expert, c.num_tiles,
                        static_cast<int>(a.el <= 32)))
      return rc;
  }

  int rc = 0;
  if (path == 8) {
    with_v8_config(bt, [&](auto cfg) {
      rc = launch_v8<decltype(cfg)>(g1, g2, p.t_max, a.h, a.inter, stream);
    });
  } else {
    rc = with_v6_config(routes, a.h, a.inter, [&](auto cfg) {
      return launch_v6<decltype(cfg)>(g1, g2, p.t_max, rows, routes, a.h, a.inter, a.el,
                                      a.num_experts, self ? &sr : nullptr, stream);
    });
  }
  if (rc) return rc;

  const bool batched = a.m < kFinBatchedMaxTokens;
  return launch("finalize_kernel", batched ? finalize_kernel<true> : finalize_kernel<false>,
                dim3(static_cast<unsigned>(a.m)), dim3(batched ? fin_threads_for(a.h) : 256),
                static_cast<size_t>(a.top_k) * 8, stream, c.pos_of_route,
                static_cast<const float*>(a.topk_weights), a.top_k,
                static_cast<const uint16_t*>(c.z), static_cast<const float*>(c.partial),
                p.nparts, p.pcap, a.h, a.rms_norm, static_cast<uint16_t*>(a.out));
}

}  // extern "C"
