// expertd: calls that a client's CUDA stream starts on this GPU with no host between them
// ("armed" calls; the server arms them, server/armed.py).
//
// One armed graph serves one ring entry of one lease. The host queues, on a stream of its
// own: the entry's number into `entry` (a stream write), a wait until the lease's ring word
// for that entry reaches it (the client's stream writes it after the call's rows), then this
// graph:
//
//   arm      reads the entry (which slot), the slot's control words (layer, m, k, flags) and
//            routes through the host mapping of the client's control block, checks what the
//            forward needs to stay inside its buffers (m, k, layer, every id in [-1, E)),
//            copies x, ids and weights into the bank's packed input at the bucket's layout
//            (rows past m and routes past k are "no route"), and picks the body: layer's
//            index * buckets + the bucket's index, or none (the host then runs the call;
//            so it does for an entry the host cancelled: a lease idle too long, or ending).
//   switch   one body per (layer, bucket): the bank's captured forward of that bucket.
//   deliver  copies the m output rows into the slot's out region and ORs the rows' NaN/Inf
//            flags; then one thread stores taken_seq and the flag into the control block and,
//            after a system-wide fence, done_seq: the client's stream goes on.
//
// Nothing here allocates or syncs; the graph is built once per lease and launched per entry.

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace {

constexpr int kThreads = 256;
constexpr unsigned kFlagStream = 2;  // FLAG_STREAM in expertd/dataplane.py
constexpr long long kAlign = 512;    // server/graphs.py ALIGN

thread_local char g_armed_error[256] = "";

int fail(const char* what, cudaError_t e) {
  snprintf(g_armed_error, sizeof(g_armed_error), "%s: %s", what, cudaGetErrorString(e));
  return -1;
}

__host__ __device__ __forceinline__ long long aligned(long long n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

extern "C" {

// One slot of the lease, as this process's device addresses.
struct ExpertdArmSlot {
  const uint8_t* ctl;  // the control block (host memory mapped for the GPU)
  const uint8_t* x;    // bf16 [max_tokens, H] (device)
  uint8_t* out;        // bf16 [max_tokens, H] (device)
};

// Word offsets (bytes) in a control block; mirrors expertd/dataplane.py Control.
struct ExpertdArmWords {
  int req_seq, layer, m, k, flags, done_seq, taken_seq, armed_bad;
  long long ids, weights;  // the routes regions: int32 / fp32 [max_tokens * top_k]
};

struct ExpertdArmPlan {
  const ExpertdArmSlot* slots;  // device array [num_slots]
  int num_slots;
  const uint32_t* ring_seq;     // [ring] entry n's number once its call is written
  const uint32_t* ring_slot;    // [ring] entry n's slot index
  int ring;
  const uint32_t* entry;        // device word: the entry this launch serves
  const uint32_t* cancel;       // entries up to this one (mod 2^32) are the host's
  const int* layer_body;        // device [num_layers]: the layer's body index, -1 if none
  int num_layers;
  const int* buckets;           // device [num_buckets], ascending
  int num_buckets;
  int top_k;                    // the bank's routes per row
  int hidden;
  int num_experts;
  uint8_t* bank_in;             // the bank's packed input (server/graphs.py Layout)
  const uint8_t* bank_out;      // the bank's packed output
  int* info;                    // device [6]: body, m, slot, seq, bucket, bad
  ExpertdArmWords words;
};

}  // extern "C"

namespace {

__device__ __forceinline__ uint32_t load_sys(const uint8_t* base, int offset) {
  return *reinterpret_cast<const volatile uint32_t*>(base + offset);
}

// Every block decides alike (a handful of mapped reads); block 0 checks and copies the
// routes and sets the switch, the others copy x.
__global__ void __launch_bounds__(kThreads) arm_kernel(const ExpertdArmPlan p,
                                                     cudaGraphConditionalHandle handle) {
  __shared__ int s_body, s_m, s_k, s_slot, s_bucket;
  __shared__ uint32_t s_seq;
  const int none = p.num_layers * p.num_buckets;
  if (threadIdx.x == 0) {
    int body = -1, m = 0, k = 0, slot = -1, bucket = 0;
    uint32_t seq = 0;
    const uint32_t n = *reinterpret_cast<const volatile uint32_t*>(p.entry);
    const int e = static_cast<int>(n % static_cast<uint32_t>(p.ring));
    const uint32_t cancel = *reinterpret_cast<const volatile uint32_t*>(p.cancel);
    if (reinterpret_cast<const volatile uint32_t*>(p.ring_seq)[e] == n &&
        static_cast<int32_t>(cancel - n) < 0) {
      slot = static_cast<int>(reinterpret_cast<const volatile uint32_t*>(p.ring_slot)[e]);
      if (slot >= 0 && slot < p.num_slots) {
        const uint8_t* ctl = p.slots[slot].ctl;
        const uint32_t layer = load_sys(ctl, p.words.layer);
        m = static_cast<int>(load_sys(ctl, p.words.m));
        k = static_cast<int>(load_sys(ctl, p.words.k));
        seq = load_sys(ctl, p.words.req_seq);
        const uint32_t flags = load_sys(ctl, p.words.flags);
        const int cap = p.buckets[p.num_buckets - 1];
        if ((flags & kFlagStream) && m >= 1 && m <= cap && k >= 1 && k <= p.top_k &&
            layer < static_cast<uint32_t>(p.num_layers) && p.layer_body[layer] >= 0) {
          while (p.buckets[bucket] < m) ++bucket;
          body = p.layer_body[layer] * p.num_buckets + bucket;
        }
      }
    }
    s_body = body;
    s_m = m;
    s_k = k;
    s_slot = slot;
    s_bucket = bucket;
    s_seq = seq;
  }
  __syncthreads();
  int body = s_body;
  const int m = s_m, k = s_k;
  if (body < 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      p.info[0] = -1;
      cudaGraphSetConditional(handle, none);
    }
    return;
  }
  const ExpertdArmSlot slot = p.slots[s_slot];
  const long long rows = p.buckets[s_bucket];
  const long long routes = aligned(4 * rows * p.top_k);
  if (blockIdx.x == 0) {
    const int* ids = reinterpret_cast<const int*>(slot.ctl + p.words.ids);
    const float* w = reinterpret_cast<const float*>(slot.ctl + p.words.weights);
    int* ids_out = reinterpret_cast<int*>(p.bank_in);
    float* w_out = reinterpret_cast<float*>(p.bank_in + routes);
    int bad = 0;
    for (long long i = threadIdx.x; i < rows * p.top_k; i += blockDim.x) {
      const long long r = i / p.top_k, j = i % p.top_k;
      int id = -1;
      float wt = 0.0f;
      if (r < m && j < k) {
        id = ids[r * k + j];
        wt = w[r * k + j];
        bad |= id < -1 || id >= p.num_experts;
      }
      ids_out[i] = id;
      w_out[i] = wt;
    }
    if (__syncthreads_or(bad)) body = -1;
    if (threadIdx.x == 0) {
      p.info[0] = body;
      p.info[1] = m;
      p.info[2] = s_slot;
      p.info[3] = static_cast<int>(s_seq);
      p.info[4] = s_bucket;
      p.info[5] = 0;
      cudaGraphSetConditional(handle, body < 0 ? none : body);
    }
    if (gridDim.x > 1) return;
  }
  // x: m rows of H bf16, 16 bytes at a time, over the blocks (block 0 too when alone)
  const int workers = gridDim.x > 1 ? gridDim.x - 1 : 1;
  const int me = gridDim.x > 1 ? blockIdx.x - 1 : 0;
  const long long n16 = static_cast<long long>(m) * p.hidden * 2 / 16;
  const uint4* src = reinterpret_cast<const uint4*>(slot.x);
  uint4* dst = reinterpret_cast<uint4*>(p.bank_in + 2 * routes);
  for (long long i = me * static_cast<long long>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<long long>(workers) * blockDim.x)
    dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) deliver_kernel(const ExpertdArmPlan p) {
  const int body = p.info[0];
  if (body < 0) return;
  const int m = p.info[1];
  const ExpertdArmSlot slot = p.slots[p.info[2]];
  const long long rows = p.buckets[p.info[4]];
  const uint8_t* out = p.bank_out + aligned(rows);
  const long long n16 = static_cast<long long>(m) * p.hidden * 2 / 16;
  const uint4* src = reinterpret_cast<const uint4*>(out);
  uint4* dst = reinterpret_cast<uint4*>(slot.out);
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
  if (blockIdx.x == 0) {
    int bad = 0;
    for (int r = threadIdx.x; r < m; r += blockDim.x) bad |= p.bank_out[r] != 0;
    if (__syncthreads_or(bad) && threadIdx.x == 0) p.info[5] = 1;
  }
}

__global__ void bell_kernel(const ExpertdArmPlan p) {
  if (p.info[0] < 0) return;
  uint8_t* ctl = const_cast<uint8_t*>(p.slots[p.info[2]].ctl);
  const uint32_t seq = static_cast<uint32_t>(p.info[3]);
  *reinterpret_cast<volatile uint32_t*>(ctl + p.words.armed_bad) = p.info[5];
  *reinterpret_cast<volatile uint32_t*>(ctl + p.words.taken_seq) = seq;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(ctl + p.words.done_seq) = seq;
  __threadfence_system();
}

}  // namespace

extern "C" {

const char* expertd_armed_error(void) { return g_armed_error; }

// A non-blocking stream (no implicit order with the legacy default stream: a wait queued on
// it never holds up other work of this process).
int expertd_armed_stream(void** stream) {
  cudaStream_t s;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) return fail("cudaStreamCreateWithFlags", e);
  *stream = s;
  return 0;
}

int expertd_armed_stream_destroy(void* stream) {
  cudaError_t e = cudaStreamDestroy(static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? 0 : fail("cudaStreamDestroy", e);
}

// Build and instantiate the armed graph: arm (grid blocks) -> switch over `bodies` (graphs
// cloned as children, in body order) -> deliver (grid blocks) -> bell. *exec, *graph: the
// instance and its graph (both freed by expertd_armed_destroy).
int expertd_armed_build(const ExpertdArmPlan* plan, void* const* bodies, int num_bodies,
                        int grid, void** exec, void** graph) {
  if (num_bodies != plan->num_layers * plan->num_buckets || num_bodies < 1 || grid < 1) {
    snprintf(g_armed_error, sizeof(g_armed_error), "armed graph: %d bodies for %d x %d, grid %d",
             num_bodies, plan->num_layers, plan->num_buckets, grid);
    return -1;
  }
  cudaGraph_t g = nullptr;
  cudaGraphExec_t x = nullptr;
  cudaError_t e = cudaGraphCreate(&g, 0);
  if (e != cudaSuccess) return fail("cudaGraphCreate", e);
  auto bail = [&](const char* what, cudaError_t err) {
    cudaGraphDestroy(g);
    return fail(what, err);
  };
  cudaGraphConditionalHandle handle;
  e = cudaGraphConditionalHandleCreate(&handle, g, static_cast<unsigned>(num_bodies),
                                       cudaGraphCondAssignDefault);
  if (e != cudaSuccess) return bail("cudaGraphConditionalHandleCreate", e);

  ExpertdArmPlan p = *plan;
  void* arm_args[] = {&p, &handle};
  cudaKernelNodeParams kp = {};
  kp.func = reinterpret_cast<void*>(arm_kernel);
  kp.gridDim = dim3(grid);
  kp.blockDim = dim3(kThreads);
  kp.kernelParams = arm_args;
  cudaGraphNode_t arm, sw, deliver, bell;
  e = cudaGraphAddKernelNode(&arm, g, nullptr, 0, &kp);
  if (e != cudaSuccess) return bail("arm node", e);

  cudaGraphNodeParams cp = {};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = handle;
  cp.conditional.type = cudaGraphCondTypeSwitch;
  cp.conditional.size = static_cast<unsigned>(num_bodies);
  e = cudaGraphAddNode(&sw, g, &arm, nullptr, 1, &cp);
  if (e != cudaSuccess) return bail("switch node", e);
  for (int i = 0; i < num_bodies; ++i) {
    cudaGraphNode_t child;
    e = cudaGraphAddChildGraphNode(&child, cp.conditional.phGraph_out[i], nullptr, 0,
                                   static_cast<cudaGraph_t>(bodies[i]));
    if (e != cudaSuccess) return bail("switch body", e);
  }

  void* plan_args[] = {&p};
  kp.func = reinterpret_cast<void*>(deliver_kernel);
  kp.kernelParams = plan_args;
  e = cudaGraphAddKernelNode(&deliver, g, &sw, 1, &kp);
  if (e != cudaSuccess) return bail("deliver node", e);
  kp.func = reinterpret_cast<void*>(bell_kernel);
  kp.gridDim = dim3(1);
  kp.blockDim = dim3(1);
  e = cudaGraphAddKernelNode(&bell, g, &deliver, 1, &kp);
  if (e != cudaSuccess) return bail("bell node", e);

  e = cudaGraphInstantiate(&x, g, 0);
  if (e != cudaSuccess) return bail("cudaGraphInstantiate", e);
  *exec = x;
  *graph = g;
  return 0;
}

int expertd_armed_launch(void* exec, void* stream) {
  cudaError_t e =
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(stream));
  return e == cudaSuccess ? 0 : fail("cudaGraphLaunch", e);
}

int expertd_armed_destroy(void* exec, void* graph) {
  cudaError_t e = cudaSuccess;
  if (exec) e = cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
  if (graph) cudaGraphDestroy(static_cast<cudaGraph_t>(graph));
  return e == cudaSuccess ? 0 : fail("cudaGraphExecDestroy", e);
}

}  // extern "C"
