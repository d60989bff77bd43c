// Microbenchmark: throughput of Hopper's register-A warpgroup MMA (wgmma "RS" form:
// A = bf16 fragments in registers, B = bf16 tile in shared memory) at small N, alone and with
// ALU work interleaved the way the v8 GEMM (kernels/csrc/moe_nvfp4.cu, v8_tile ring 3) does it.
//
// Question it answers: at N = 16..160, how close to the dense bf16 tensor peak can a stream of
// wgmma.mma_async m64nNk16 (4 k-steps per commit group, wait_group 0 after every group) get,
// and how much of that survives when every warp also spends ALU ops per 8 A values producing
// the A registers of its next group (v8 dequantizes FP4 with ~15 LOP3/SHF/HMUL2 ops per 8).
// If v8 at N = 32-64 runs near the "ALU = 16" rate measured here, its loads are hidden and it is
// limited by what limits this loop (tensor pipe, plus issuing the dequant ops); if the ALU = 0
// rate itself is far below peak at small N, the wgmma shape is the limit, not the dequant.
//
// Build and run (sm_90a only):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels/csrc \
//        -o $OUT/wgmma_rs benchmarks/wgmma_rs.cu && $OUT/wgmma_rs
// Output: one line per case, two summary tables, JSON lines in $OUT/wgmma_rs.json (OUT: /tmp).
//
// What one warpgroup does (kernel `bench`): a loop of ITER "units"; a unit is 4 wgmmas
// (k-steps 0..3 of one 64-k group of the B tile) into one accumulator set, one commit group,
// then wgmma.wait_group 0. With ALU > 0 there are two A register sets: the unit issued on set
// X runs while the warp computes set Y (ALU ops per k-step per thread, from Y's previous
// values), then the wait, then the sets swap. No instruction writes a register that an
// in-flight wgmma reads (ptxas would serialize the wgmmas: warning C7513). ALU variants come
// twice: as ptxas schedules them (it hoists them above / between the unit's HGMMAs, as it does
// in v8) and "STRICT" ("16s" in the output: all ALU ops after the unit's 4th HGMMA).
// Resident warpgroups per SM: 1 (1 block x 1 WG), 2 (1 x 2) or 4 (2 x 2); the block count per
// SM is forced by the dynamic shared-memory request, and checked from %smid.
// Two rates are reported: TFLOP/s from cudaEvent time (includes launch + tail), and tensor
// utilization = flops per SM / (SM clock cycles spent by its blocks, from clock64) / 4096,
// which does not depend on the clock the GPU happened to run at.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "wgmma.cuh"

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                  \
                   cudaGetErrorString(e_));                                            \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

namespace {

// ------------------------------------ wgmma plumbing --------------------------------------
// wgmma_fence / wgmma_commit / wgmma_wait, reg_fence (pins a register: code producing it stays
// before, code consuming it after, in program order relative to the wgmma asm) and
// smem_desc_sw128 (the 128-byte-swizzle B descriptor) come from wgmma.cuh, as for the v8 GEMM.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------ ALU work ------------------------------------------
// Each helper is one PTX instruction that ptxas maps to one SASS instruction (SHF.L.W, LOP3,
// HMUL2.BF16). Non-volatile asm: ptxas schedules them freely, but cannot fold them away.

__device__ __forceinline__ uint32_t rotl(uint32_t x, uint32_t s) {
  uint32_t d;
  asm("shf.l.wrap.b32 %0, %1, %1, %2;\n" : "=r"(d) : "r"(x), "r"(s));
  return d;
}
template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Sign bit 15 and bits 6-8 of each bf16 half: like v8's E2M1 unpack, the masked value times
// 2^126 (the scale below) is an E2M1 value (0, 0.5, ..., 6, signed), so A stays finite.
constexpr uint32_t kMask = 0x81C081C0u;
constexpr uint32_t kScale = 0x7E807E80u;  // bf16x2 {2^126, 2^126}

// One new A register from P dependent ops (P = ALU / 4, so ALU ops per 4 registers = per k-step
// = per 8 bf16 values of this thread): P - 2 alternating SHF (rotate) / LOP3 (xor3 with a
// constant), then LOP3 (x ^ ~w) & mask, then HMUL2 by the scale. P = 4 (ALU = 16) is close to
// v8's dequant mix (11 LOP3/SHF + 4 HMUL2 per k-step, plus its shared-memory loads, absent here).
// u, v, w: three registers of the previous contents of the same set and k-step, so every chain
// depends on the loop (nothing can be hoisted) and no two ops fuse into one LOP3.
template <int P, int C>
__device__ __forceinline__ uint32_t alu_chain(uint32_t u, uint32_t v, uint32_t w, uint32_t scale) {
  uint32_t x = u;
#pragma unroll
  for (int j = 0; j < P - 2; ++j) {
    if (j % 2 == 0)
      x = rotl(x, 3u + 2u * C + 5u * j);
    else
      x = lop3<0x96>(x, v, 0x9E3779B9u * (j + 4 * C + 1));  // x ^ v ^ K
  }
  x = lop3<0x82>(x, w, kMask);  // (x ^ ~w) & mask
  return hmul2(x, scale);
}

// Recompute one A register set (4 k-steps x 4 registers) from its previous values with ALU ops
// per k-step. Called right after the other set's unit was committed and before its wait, so the
// ops overlap the wgmmas in flight; the pins keep them between the commit and the wait.
template <int ALU>
__device__ __forceinline__ void refill(uint32_t (&a)[4][4], uint32_t scale) {
  constexpr int P = ALU / 4;
  static_assert(ALU % 4 == 0 && P >= 2, "ALU: 8, 12, 16, ... ops per k-step");
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int c = 0; c < 4; ++c) reg_fence(a[ks][c]);
  uint32_t n[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    n[ks][0] = alu_chain<P, 0>(a[ks][0], a[ks][1], a[ks][2], scale);
    n[ks][1] = alu_chain<P, 1>(a[ks][1], a[ks][2], a[ks][3], scale);
    n[ks][2] = alu_chain<P, 2>(a[ks][2], a[ks][3], a[ks][0], scale);
    n[ks][3] = alu_chain<P, 3>(a[ks][3], a[ks][0], a[ks][1], scale);
  }
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      a[ks][c] = n[ks][c];
      reg_fence(a[ks][c]);
    }
}

// One unit: the 4 k-steps of a 64-k group, each m64nNk16 with A = a[ks], B = rows 0..N-1 of the
// tile at k 16 ks (descriptor start + 32 bytes per k-step), all into acc; one commit group.
template <int N>
__device__ __forceinline__ void issue_unit(uint32_t (&a)[4][4], float (&acc)[N / 2],
                                           uint64_t desc0) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int c = 0; c < 4; ++c) reg_fence(a[ks][c]);
  wgmma_fence();  // A registers (written by ordinary instructions) before the wgmmas read them
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) Wgmma<N>::mma(acc, a[ks], desc0 + ((ks * 32) >> 4));
  wgmma_commit();
}

// wgmma m64nNk16 in the SS form (A from shared memory through a descriptor, K-major, 128-byte
// swizzle, like B): the split benchmark's question is whether tensor work without register-file
// A operands competes less with other warps' ALU work (NOTES.md, session 21).
template <int N>
struct WgmmaSS;

template <>
struct WgmmaSS<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db));
  }
};

template <>
struct WgmmaSS<48> {
  static __device__ __forceinline__ void mma(float (&d)[24], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "l"(da), "l"(db));
  }
};

template <>
struct WgmmaSS<64> {
  static __device__ __forceinline__ void mma(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
  }
};

// One unit in the SS form: 4 k-steps with A (64 rows x 64 k, swizzled like B) from shared memory.
template <int N>
__device__ __forceinline__ void issue_unit_ss(float (&acc)[N / 2], uint64_t desc_a,
                                              uint64_t desc_b) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    WgmmaSS<N>::mma(acc, desc_a + ((ks * 32) >> 4), desc_b + ((ks * 32) >> 4));
  wgmma_commit();
}

// refill plus one 16-byte shared-memory store per k-step (the 4 new A registers of that k-step):
// the ALU side of a design whose dequantizing warps hand bf16 A tiles to the MMA warps through
// shared memory (8 bf16 per thread per k-step, as v8 produces them).
template <int ALU>
__device__ __forceinline__ void refill_sts(uint32_t (&a)[4][4], uint32_t scale, uint32_t dst) {
  refill<ALU>(a, scale);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + ks * 2048),
                 "r"(a[ks][0]), "r"(a[ks][1]), "r"(a[ks][2]), "r"(a[ks][3])
                 : "memory");
}

struct Args {
  float* out;      // one value per thread (keeps the accumulators live)
  long long* rec;  // per block: clock64 at loop start, at loop end, %smid
  int iters;       // units per warpgroup (even)
  int never;       // -1: a loop index the STRICT branch compares against (opaque to the compiler)
  uint32_t scale;  // kScale, passed at run time so nothing folds
};

// N: wgmma width (B tile rows). ALU: 0 (wgmma only) or ALU ops per k-step per thread.
// Up to 2 warpgroups per block (blockDim 128 or 256). N <= 128: <= 128 registers, so 2 blocks
// (4 WG) fit per SM. N = 160 with ALU work needs ~140 (80 accumulators + 2 x 16 A + chain
// temporaries): capped at 128 it spills, so it gets 1 block per SM and 4 WG/SM is skipped.
// STRICT (ALU > 0 only): 0 = ptxas's own schedule, which hoists part of the ALU work above and
// between the unit's 4 HGMMAs (v8's SASS looks the same way: ~15 dequant ops between
// WARPGROUP.ARRIVE and the first HGMMA, ~60 between the HGMMAs). 1 = the ALU work sits in its own
// basic block after the 4th HGMMA (a branch on it != args.never, never taken: ptxas schedules
// within blocks), so the 4 HGMMAs issue back to back and all ALU ops overlap their execution.
// 2 = ping-pong between the block's two warpgroups; 3-5 = the tensor and ALU work split between
// them (see the loop). 2-5 need blocks of 2 warpgroups.
// End of a bench block: one value per thread (keeps the accumulators and A registers live) and,
// from thread 0, the block's clock64 span and SM.
__device__ __forceinline__ void finish_block(const Args& args, long long t0, long long t1,
                                             float v) {
  args.out[blockIdx.x * blockDim.x + threadIdx.x] = v;
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    args.rec[blockIdx.x * 3 + 0] = t0;
    args.rec[blockIdx.x * 3 + 1] = t1;
    args.rec[blockIdx.x * 3 + 2] = sm;
  }
}

// Named barriers 1 and 2 over the block's 256 threads (barrier 0 is __syncthreads).
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

template <int N, int ALU, int STRICT>
__global__ void __launch_bounds__(256, (N <= 128 ? 2 : 1)) bench(const Args args) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // 128-byte swizzle atoms: 1024-byte aligned
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(smem_raw + (base - raw));
  // B tile: N rows x 64 k, small values (the swizzle only permutes them; contents don't matter).
  for (int i = threadIdx.x; i < N * 64; i += blockDim.x)
    b[i] = __float2bfloat16(static_cast<float>((i * 37) % 13 - 6) * (1.0f / 64.0f));
  // Generic-proxy stores, read by wgmma through the async proxy.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint64_t desc0 = smem_desc_sw128(base);
  const uint32_t scale = args.scale;
  // SS forms (STRICT 6-9): an A tile (64 rows x 64 k) 8 KB above B, and 8 KB per warpgroup of
  // scratch for refill_sts 16 KB above B (N <= 64 there).
  const uint64_t desc_a = smem_desc_sw128(base + 8192);
  const uint32_t sts_dst = base + 16384 + (threadIdx.x % 128) * 16;
  if constexpr (STRICT >= 6) {
    __nv_bfloat16* at = reinterpret_cast<__nv_bfloat16*>(smem_raw + (base - raw) + 8192);
    for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x)
      at[i] = __float2bfloat16(static_cast<float>((i * 29) % 11 - 5) * 0.5f);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
  }

  // Two A sets with E2M1-like values that differ per thread, k-step and register.
  uint32_t a0[4][4], a1[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint32_t s = threadIdx.x * 0x9E3779B1u + ks * 0x85EBCA77u + c * 0xC2B2AE3Du;
      a0[ks][c] = hmul2(s & kMask, scale);
      a1[ks][c] = hmul2((s * 0x27D4EB2Fu) & kMask, scale);
    }
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;

  const long long t0 = clock64();
  for (int it = 0; it < args.iters; it += 2) {
    if constexpr (ALU == 0) {
      // Pure tensor stream: same A set every unit, wait_group 0 after each unit (as v8).
      issue_unit<N>(a0, acc, desc0);
      wgmma_wait<0>();
      issue_unit<N>(a0, acc, desc0);
      wgmma_wait<0>();
    } else if constexpr (STRICT == 0) {
      // Ring of two A sets: issue on one, compute the other under the wgmmas, wait, swap.
      issue_unit<N>(a0, acc, desc0);
      refill<ALU>(a1, scale);
      wgmma_wait<0>();
      issue_unit<N>(a1, acc, desc0);
      refill<ALU>(a0, scale);
      wgmma_wait<0>();
    } else if constexpr (STRICT == 1) {
      // Same ring, each refill behind a branch that is never taken at run time.
      issue_unit<N>(a0, acc, desc0);
      if (it != args.never) refill<ALU>(a1, scale);
      wgmma_wait<0>();
      issue_unit<N>(a1, acc, desc0);
      if (it != args.never) refill<ALU>(a0, scale);
      wgmma_wait<0>();
    } else if constexpr (STRICT == 2) {
      // Ping-pong (FlashAttention-3's warpgroup schedule): the two warpgroups of a block take
      // turns issuing units (named barriers 1 and 2), so one computes while the other's wgmmas
      // run. Otherwise the ring of STRICT 0.
      const int wg = threadIdx.x / 128;
      if (it == 0 && wg == 1) named_arrive(1);  // warpgroup 0 issues first
      // The refills sit behind never-taken branches (as STRICT 1): ptxas would otherwise
      // schedule them between the HGMMAs, before the arrive, and the other warpgroup would wait
      // for them.
      named_sync(1 + wg);
      issue_unit<N>(a0, acc, desc0);
      named_arrive(2 - wg);
      if (it != args.never) refill<ALU>(a1, scale);
      wgmma_wait<0>();
      named_sync(1 + wg);
      issue_unit<N>(a1, acc, desc0);
      named_arrive(2 - wg);
      if (it != args.never) refill<ALU>(a0, scale);
      wgmma_wait<0>();
    } else if constexpr (STRICT >= 6) {
      // Split with the SS form (6-9): warpgroup 0 issues SS units (A from shared memory),
      // warpgroup 1 runs the ALU chains (8, 9: plus refill_sts's stores). 6, 8: both; 7:
      // warpgroup 0 alone; 9: warpgroup 1 alone (ALU + stores). Against 3-5: does tensor work
      // with no register-file A operand suffer less from the other warpgroup's ALU work?
      const int wg = threadIdx.x / 128;
      if (wg == 0 && STRICT != 9) {
        issue_unit_ss<N>(acc, desc_a, desc0);
        wgmma_wait<0>();
        issue_unit_ss<N>(acc, desc_a, desc0);
        wgmma_wait<0>();
      } else if (wg == 1 && STRICT != 7) {
        if constexpr (STRICT == 8 || STRICT == 9) {
          refill_sts<ALU>(a1, scale, sts_dst);
          refill_sts<ALU>(a0, scale, sts_dst);
        } else {
          refill<ALU>(a1, scale);
          refill<ALU>(a0, scale);
        }
      }
    } else {
      // Split (3, 4, 5): warpgroup 0 only issues units (as ALU 0), warpgroup 1 only computes
      // (ALU ops per k-step as in the ring, no wgmma). 4: warpgroup 0's part alone, 5:
      // warpgroup 1's alone. Does a warpgroup's ALU work slow another one's wgmmas down?
      const int wg = threadIdx.x / 128;
      if (wg == 0 && STRICT != 5) {
        issue_unit<N>(a0, acc, desc0);
        wgmma_wait<0>();
        issue_unit<N>(a0, acc, desc0);
        wgmma_wait<0>();
      } else if (wg == 1 && STRICT != 4) {
        refill<ALU>(a1, scale);
        refill<ALU>(a0, scale);
      }
    }
  }
  if constexpr (STRICT == 2)
    if (threadIdx.x < 128) named_sync(1);  // warpgroup 1's last arrive
  __syncthreads();
  const long long t1 = clock64();

  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  uint32_t x = 0;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int c = 0; c < 4; ++c) x ^= a0[ks][c] ^ (ALU > 0 ? a1[ks][c] : 0u);
  finish_block(args, t0, t1, s + static_cast<float>(x & 1u));
}

// ------------------------------------ mma.sync (HMMA) ----------------------------------
// The same question for the legacy warp-level MMA (v6's path): mma.sync m16n8k16, A = 4
// registers per 16 x 16 m-tile per thread (the same fragment v8 feeds to wgmma), B from the same
// swizzled shared-memory tile through ldmatrix every k-step (as v6 reloads it), WM m-tiles per
// warp sharing B. mma.sync is synchronous for the issuing warp's registers (the scoreboard waits
// on A only where a later instruction rewrites it), so the ALU chain for k-step ks of the next
// unit runs beside the HMMAs of this one. Utilization uses the same 4096 flop/clk/SM (the wgmma
// peak), so the two tables compare directly.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void hmma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                     uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N: tokens (multiple of 16); WM: m-tiles per warp; ALU: ops per k-step per m-tile per thread.
template <int N, int WM, int ALU>
__global__ void __launch_bounds__(256, 1) bench_hmma(const Args args) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(smem_raw + (base - raw));
  for (int i = threadIdx.x; i < N * 64; i += blockDim.x)
    b[i] = __float2bfloat16(static_cast<float>((i * 37) % 13 - 6) * (1.0f / 64.0f));
  __syncthreads();
  const int lane = threadIdx.x & 31;
  // ldmatrix.x4 row addresses: matrices (n-tile j, k half h) for j in {2q, 2q + 1}, h in {0, 1};
  // lane l gives row n = 16 q + 8 (l / 16) + l % 8, k half (l / 8) % 2; swizzled 16-byte chunk.
  uint32_t rowaddr[N / 16];
#pragma unroll
  for (int q = 0; q < N / 16; ++q) {
    const int n = 16 * q + 8 * (lane / 16) + (lane % 8);
    rowaddr[q] = base + n * 128;
  }
  const int khalf = (lane / 8) % 2;
  const int nsw = lane % 8;  // row % 8 for the swizzle (16 q + 8 (l / 16) keeps l % 8)
  const uint32_t scale = args.scale;
  uint32_t a[4][WM][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int m = 0; m < WM; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t s = threadIdx.x * 0x9E3779B1u + ks * 0x85EBCA77u + (4 * m + c) * 0xC2B2AE3Du;
        a[ks][m][c] = hmul2(s & kMask, scale);
      }
  float acc[WM][N / 8][4];
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.0f;

  const long long t0 = clock64();
  for (int it = 0; it < args.iters; ++it) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t bf[N / 16][4];
      const uint32_t chunk = static_cast<uint32_t>(((2 * ks + khalf) ^ nsw) * 16);
#pragma unroll
      for (int q = 0; q < N / 16; ++q) ldsm_x4(rowaddr[q] + chunk, bf[q]);
#pragma unroll
      for (int m = 0; m < WM; ++m)
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
          hmma(acc[m][j], a[ks][m], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
      if constexpr (ALU > 0) {
        // This k-step's A for the next unit, from its current values (read by the HMMAs above).
        constexpr int P = ALU / 4;
#pragma unroll
        for (int m = 0; m < WM; ++m) {
          uint32_t (&r)[4] = a[ks][m];
          const uint32_t n0 = alu_chain<P, 0>(r[0], r[1], r[2], scale);
          const uint32_t n1 = alu_chain<P, 1>(r[1], r[2], r[3], scale);
          const uint32_t n2 = alu_chain<P, 2>(r[2], r[3], r[0], scale);
          const uint32_t n3 = alu_chain<P, 3>(r[3], r[0], r[1], scale);
          r[0] = n0;
          r[1] = n1;
          r[2] = n2;
          r[3] = n3;
        }
      }
    }
  }
  __syncthreads();
  const long long t1 = clock64();

  float s = 0.0f;
#pragma unroll
  for (int m = 0; m < WM; ++m)
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s += acc[m][j][i];
  uint32_t x = 0;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int m = 0; m < WM; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) x ^= a[ks][m][c];
  finish_block(args, t0, t1, s + static_cast<float>(x & 1u));
}

// ------------------------------------ host ----------------------------------------------

using Kernel = void (*)(Args);
// One instance: family 0 = wgmma (bench<N, ALU, STRICT>), 1 = mma.sync (bench_hmma<N, WM, ALU>).
struct Inst {
  int family, n, alu, strict, wm;
  Kernel k;
};

template <int N>
void add_n(std::vector<Inst>& v) {
  v.push_back({0, N, 0, 0, 1, bench<N, 0, 0>});
  v.push_back({0, N, 8, 0, 1, bench<N, 8, 0>});
  v.push_back({0, N, 16, 0, 1, bench<N, 16, 0>});
  v.push_back({0, N, 32, 0, 1, bench<N, 32, 0>});
  v.push_back({0, N, 8, 1, 1, bench<N, 8, 1>});
  v.push_back({0, N, 16, 1, 1, bench<N, 16, 1>});
  v.push_back({0, N, 32, 1, 1, bench<N, 32, 1>});
}
template <int... Ns>
void add_ns(std::vector<Inst>& v) {
  (add_n<Ns>(v), ...);
}
// Ping-pong and split instances (blocks of 2 warpgroups only).
template <int N>
void add_pingpong(std::vector<Inst>& v) {
  v.push_back({0, N, 16, 2, 1, bench<N, 16, 2>});
  v.push_back({0, N, 16, 3, 1, bench<N, 16, 3>});
  v.push_back({0, N, 16, 4, 1, bench<N, 16, 4>});
  v.push_back({0, N, 16, 5, 1, bench<N, 16, 5>});
}
// The split with the SS form beside the RS one (N <= 64: the A tile and scratch fit above B).
template <int N>
void add_ss(std::vector<Inst>& v) {
  for (int st = 3; st <= 9; ++st) {
    static constexpr Kernel ks[] = {bench<N, 16, 3>, bench<N, 16, 4>, bench<N, 16, 5>,
                                    bench<N, 16, 6>, bench<N, 16, 7>, bench<N, 16, 8>,
                                    bench<N, 16, 9>};
    v.push_back({0, N, 16, st, 1, ks[st - 3]});
  }
}
template <int N, int WM>
void add_hmma(std::vector<Inst>& v) {
  v.push_back({1, N, 0, 0, WM, bench_hmma<N, WM, 0>});
  v.push_back({1, N, 8, 0, WM, bench_hmma<N, WM, 8>});
  v.push_back({1, N, 16, 0, WM, bench_hmma<N, WM, 16>});
}

// Threads per block and resident blocks per SM. wgmma: 1, 2, 4 warpgroups per SM; mma.sync: 8
// and 16 warps per SM (v6 runs 8-16).
struct Layout {
  int threads, blocks_per_sm;
};
constexpr Layout kWgLayouts[] = {{128, 1}, {256, 1}, {256, 2}};
constexpr Layout kHmmaLayouts[] = {{256, 1}, {256, 2}};
constexpr int kReps = 5;
constexpr double kTargetCycles = 4.0e6;  // per SM at the ideal rate: ~2 ms per launch

struct Result {
  Inst in;
  int warps_per_sm;
  bool ran;
  double ms_med, ms_min, tflops, flop_clk, mhz, clk_unit;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Flops of one unit (4 k-steps) of one warp.
double unit_flops_per_warp(const Inst& in) {
  return in.family == 0 ? 2.0 * 64 * in.n * 16 * 4.0 / 4.0 : 2.0 * 16 * in.wm * in.n * 16 * 4.0;
}

}  // namespace

int main(int argc, char** argv) {
  // widths: N = 8-48 in steps of 8 (where the MMA width stops mattering at v8's ALU load)
  // ss: the split (3-5) beside the same split with SS-form wgmmas (6-9), N = 32, 48, 64
  const std::string which = argc > 1 ? argv[1] : "all";  // wgmma|hmma|pingpong|widths|ss|all
  if (which != "all" && which != "wgmma" && which != "hmma" && which != "pingpong" &&
      which != "widths" && which != "ss") {
    std::fprintf(stderr, "usage: %s [wgmma|hmma|pingpong|widths|ss|all]\n", argv[0]);
    return 2;
  }
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int clock_khz = 0;  // cudaDeviceProp::clockRate is gone in CUDA 13: same value, as an attribute
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  if (prop.major != 9) {
    std::fprintf(stderr, "needs sm_90 (Hopper), got sm_%d%d\n", prop.major, prop.minor);
    return 1;
  }
  const int sms = prop.multiProcessorCount;
  const double peak = sms * 4096.0 * clock_khz * 1e3 / 1e12;  // dense bf16, TFLOP/s
  std::printf("device: %s, %d SMs, max SM clock %.0f MHz (cudaDevAttrClockRate)\n", prop.name, sms,
              clock_khz / 1e3);
  std::printf("dense bf16 peak: %.1f TFLOP/s = %d SMs x 4096 flop/clk x %.0f MHz; NVIDIA's H200 "
              "figure: ~989 TFLOP/s (= 4096 x 132 SMs x 1830 MHz)\n",
              peak, sms, clock_khz / 1e3);
  std::printf("ALU = ops per k-step (8 A values) per thread and m-tile; 's' = ALU work forced after "
              "the 4th HGMMA (STRICT), else ptxas's schedule; 'p' = ping-pong of 2 warpgroups; "
              "'x' = warpgroup 0 wgmma only + warpgroup 1 ALU only, 't' / 'a' = each of them "
              "alone (compare clk/unit); 'X' / 'T' = 'x' / 't' with SS-form wgmmas, 'B' = 'X' with "
              "a 16-byte store per k-step after the ALU work, 'b' = that ALU part alone; WM = "
              "m-tiles per warp (mma.sync)\n");

  const char* out_env = std::getenv("OUT");
  const std::string out_dir = out_env && *out_env ? out_env : "/tmp";
  const std::string json_path = out_dir + "/wgmma_rs.json";
  FILE* js = std::fopen(json_path.c_str(), "w");
  if (!js) {
    std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
    return 1;
  }
  std::fprintf(js,
               "{\"device\":\"%s\",\"sms\":%d,\"clock_khz\":%d,\"peak_tflops\":%.2f,"
               "\"nominal_peak_tflops\":989}\n",
               prop.name, sms, clock_khz, peak);

  std::vector<Inst> insts;
  if (which == "all" || which == "pingpong") {
    if (which == "pingpong") add_n<32>(insts);  // the ring at N = 32 beside it
    add_pingpong<32>(insts);
    add_pingpong<48>(insts);
    add_pingpong<64>(insts);
  }
  if (which == "all" || which == "wgmma") add_ns<16, 32, 48, 64, 96, 128, 160>(insts);
  if (which == "widths") add_ns<8, 16, 24, 32, 40, 48>(insts);
  if (which == "all" || which == "ss") {
    add_ss<32>(insts);
    add_ss<48>(insts);
    add_ss<64>(insts);
  }
  if (which == "all" || which == "hmma") {
    add_hmma<16, 1>(insts);
    add_hmma<16, 2>(insts);
    add_hmma<32, 1>(insts);
    add_hmma<32, 2>(insts);
    add_hmma<64, 1>(insts);
    add_hmma<64, 2>(insts);
  }

  const int max_blocks = sms * 2;
  float* d_out = nullptr;
  long long* d_rec = nullptr;
  CK(cudaMalloc(&d_out, sizeof(float) * max_blocks * 256));
  CK(cudaMalloc(&d_rec, sizeof(long long) * max_blocks * 3));
  std::vector<long long> rec(max_blocks * 3);
  std::vector<float> outv(max_blocks * 256);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  std::vector<Result> results;
  std::printf("\n%5s %4s %4s %3s %6s %7s %8s %9s %7s %10s %7s %8s %8s\n", "MMA", "N", "ALU", "WM",
              "warps", "blk", "units", "ms(med)", "TFLOP/s", "%peak@clk", "util", "SM MHz",
              "clk/unit");
  for (const Inst& in : insts) {
    const Layout* layouts = in.family == 0 ? kWgLayouts : kHmmaLayouts;
    const int nlayouts = in.family == 0 ? static_cast<int>(std::size(kWgLayouts))
                                        : static_cast<int>(std::size(kHmmaLayouts));
    for (int li = 0; li < nlayouts; ++li) {
      const Layout& L = layouts[li];
      const int threads = L.threads;
      if (in.strict >= 2 && threads != 256) continue;  // ping-pong / split: 2 warpgroups
      const int warps_per_sm = threads / 32 * L.blocks_per_sm;
      // Force exactly blocks_per_sm resident blocks per SM with the shared-memory request.
      int smem = static_cast<int>(prop.sharedMemPerMultiprocessor / L.blocks_per_sm) -
                 static_cast<int>(prop.reservedSharedMemPerBlock);
      smem = std::min(smem, static_cast<int>(prop.sharedMemPerBlockOptin));
      smem = std::max(smem, in.strict >= 6 ? 1024 + 3 * 8192 : in.n * 128 + 1024);
      CK(cudaFuncSetAttribute(in.k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      int fit = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, in.k, threads, smem));
      Result r{in, warps_per_sm, false, 0, 0, 0, 0, 0, 0};
      char alu[8];  // "16" (ptxas schedule) or "16s" (STRICT)
      std::snprintf(alu, sizeof alu, "%d%c", in.alu, " spxtaXTBb"[in.strict]);
      const char* fam = in.family == 0 ? "wgmma" : "hmma";
      if (fit < L.blocks_per_sm) {
        std::printf("%5s %4d %4s %3d %6d  skipped: only %d block(s) of %d threads fit per SM\n",
                    fam, in.n, alu, in.wm, warps_per_sm, fit, threads);
        results.push_back(r);
        continue;
      }
      const int grid = sms * L.blocks_per_sm;
      const double per_unit = unit_flops_per_warp(in) * warps_per_sm;  // per SM
      int iters = static_cast<int>(kTargetCycles * 4096.0 / per_unit);
      iters = std::max(64, iters & ~1);
      const Args args{d_out, d_rec, iters, -1, kScale};

      in.k<<<grid, threads, smem>>>(args);  // warm-up (clocks, caches, module load)
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<double> ms, util, mhz, cpu;
      bool uneven = false;
      for (int rep = 0; rep < kReps; ++rep) {
        CK(cudaEventRecord(e0));
        in.k<<<grid, threads, smem>>>(args);
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t = 0;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
        CK(cudaMemcpy(rec.data(), d_rec, sizeof(long long) * grid * 3, cudaMemcpyDeviceToHost));
        // Per SM: cycles from its first block's start to its last block's end (clock64 is one
        // counter per SM), flops of its blocks; utilization = flops / cycles / 4096.
        std::vector<long long> lo(sms, -1), hi(sms, -1);
        std::vector<int> cnt(sms, 0);
        for (int b = 0; b < grid; ++b) {
          const int sm = static_cast<int>(rec[b * 3 + 2]);
          if (sm < 0 || sm >= sms) continue;
          lo[sm] = cnt[sm] ? std::min(lo[sm], rec[b * 3]) : rec[b * 3];
          hi[sm] = cnt[sm] ? std::max(hi[sm], rec[b * 3 + 1]) : rec[b * 3 + 1];
          ++cnt[sm];
        }
        double u = 0, span = 0;
        int used = 0;
        for (int s = 0; s < sms; ++s) {
          if (cnt[s] != L.blocks_per_sm) uneven = true;
          if (!cnt[s]) continue;
          const double f = unit_flops_per_warp(in) * iters * (threads / 32) * cnt[s];
          u += f / static_cast<double>(hi[s] - lo[s]) / 4096.0;
          span += static_cast<double>(hi[s] - lo[s]);
          ++used;
        }
        util.push_back(u / used);
        cpu.push_back(span / used / iters);  // SM cycles per unit (of each warp)
        mhz.push_back(span / used / (t * 1e-3) / 1e6);  // lower bound: t includes launch
      }
      // Sanity: the accumulators (|A| <= 6, |B| <= 6/64) must stay finite.
      CK(cudaMemcpy(outv.data(), d_out, sizeof(float) * grid * threads, cudaMemcpyDeviceToHost));
      const bool finite = std::all_of(outv.begin(), outv.begin() + grid * threads,
                                      [](float v) { return std::isfinite(v); });
      const double flops =
          unit_flops_per_warp(in) * iters * (static_cast<double>(grid) * (threads / 32));
      r.ran = true;
      r.ms_med = median(ms);
      r.ms_min = *std::min_element(ms.begin(), ms.end());
      r.tflops = flops / (r.ms_med * 1e-3) / 1e12;
      r.flop_clk = median(util) * 4096.0;
      r.mhz = median(mhz);
      r.clk_unit = median(cpu);
      results.push_back(r);
      char blk[16];
      std::snprintf(blk, sizeof blk, "%dx%d", L.blocks_per_sm, threads / 32);
      std::printf("%5s %4d %4s %3d %6d %7s %8d %9.3f %7.1f %9.1f%% %6.1f%% %8.0f %8.1f%s%s\n", fam,
                  in.n, alu, in.wm, warps_per_sm, blk, iters, r.ms_med, r.tflops,
                  100.0 * r.tflops / peak, 100.0 * r.flop_clk / 4096.0, r.mhz, r.clk_unit,
                  uneven ? "  (uneven blocks per SM!)" : "", finite ? "" : "  (non-finite output!)");
      std::fprintf(js,
                   "{\"mma\":\"%s\",\"n\":%d,\"alu\":%d,\"strict\":%d,\"wm\":%d,"
                   "\"warps_per_sm\":%d,\"wg_per_sm\":%d,\"threads\":%d,"
                   "\"blocks_per_sm\":%d,\"units_per_warp\":%d,\"ms_median\":%.5f,"
                   "\"ms_min\":%.5f,\"tflops\":%.2f,\"tflops_best\":%.2f,\"pct_peak\":%.2f,"
                   "\"flop_per_clk_sm\":%.1f,\"tensor_util\":%.4f,\"sm_mhz\":%.0f,\"clk_per_unit\":%.1f,"
                   "\"uneven\":%s,"
                   "\"finite\":%s}\n",
                   fam, in.n, in.alu, in.strict, in.wm, warps_per_sm, warps_per_sm / 4, threads,
                   L.blocks_per_sm, iters, r.ms_med, r.ms_min, r.tflops,
                   flops / (r.ms_min * 1e-3) / 1e12, 100.0 * r.tflops / peak, r.flop_clk,
                   r.flop_clk / 4096.0, r.mhz, r.clk_unit, uneven ? "true" : "false",
                   finite ? "true" : "false");
      std::fflush(js);
    }
  }
  CK(cudaDeviceSynchronize());

  // Compact tables: rows MMA x N x ALU (x WM), columns warps per SM; tensor utilization.
  std::printf("\ntensor utilization, %% of 4096 flop/clk/SM (clock64 cycles; clock independent)\n");
  std::printf("%5s %4s %4s %3s   by layout (warps per SM)\n", "MMA", "N", "ALU", "WM");
  for (size_t i = 0; i < results.size();) {
    const Inst& in = results[i].in;
    std::printf("%5s %4d %3d%c %3d", in.family == 0 ? "wgmma" : "hmma", in.n, in.alu,
                " spxtaXTBb"[in.strict], in.wm);
    size_t j = i;
    for (; j < results.size() && results[j].in.k == in.k; ++j) {
      if (results[j].ran)
        std::printf("  %3dw %5.1f%%", results[j].warps_per_sm, 100.0 * results[j].flop_clk / 4096.0);
      else
        std::printf("  %3dw %6s", results[j].warps_per_sm, "-");
    }
    std::printf("\n");
    i = j;
  }
  std::fclose(js);
  std::printf("\nJSON lines: %s\n", json_path.c_str());
  CK(cudaFree(d_out));
  CK(cudaFree(d_rec));
  return 0;
}
