// One call of a lane graph, its host steps in one C call (a server's lane, server/lane.py,
// runs its calls this way).
//
// A lane graph (server/graphs.py) reads a call from a block of mapped host memory
// (call_block.h): where x comes from, where the rows go, how many, and the routes; it
// copies them to the GPU in one DMA, its first kernel moves them into place, its last
// copies the rows out and writes each row's NaN/Inf flag back into the block
// (kernels/csrc/rows.cu). A call of m tokens is then: the routes
// copied from the caller's memory into the block and checked there (ids in [-1, E): the
// copy is what the GPU reads, so the source cannot change an id after its check), padded
// to the graph's rows as "no route"; the header written; the graph launched, an optional
// 32-bit store queued behind it (a waiting stream's bell) and an event; the wait for the
// event; the flags read. From Python each step is a few microseconds of interpreter and
// ctypes; here they are one call, run without the interpreter's lock.
//
// The driver's entry points come from the caller (the ones its process loaded), so this
// file needs no CUDA header or library: the stream, graph exec and event are the driver's
// handles.

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "call_block.h"

typedef int (*expertd_launch_fn)(void* graph_exec, void* stream);  // cuGraphLaunch
typedef int (*expertd_write_fn)(void* stream, unsigned long long addr, uint32_t value,
                                unsigned int flags);           // cuStreamWriteValue32
typedef int (*expertd_record_fn)(void* event, void* stream);  // cuEventRecord
typedef int (*expertd_sync_fn)(void* event);                  // cuEventSynchronize

extern "C" {

// Fixed for the life of one (block, graph rows) pair: host addresses in the block, sizes.
struct expertd_graph_call_plan {
  expertd_call_header* header;  // the block (host address)
  int32_t* ids_host;            // its ids int32 [rows, top_k] ...
  float* weights_host;          // ... and weights fp32 [rows, top_k]
  uint8_t* flags_host;          // its flags, one per row
  int rows;                     // the graph's tokens
  int top_k;                    // the graph's routes per token
  int num_experts;              // ids must lie in [-1, num_experts)
  int pad_;
  void* stream;
  void* event;
  expertd_launch_fn launch;
  expertd_write_fn write;
  expertd_record_fn record;
  expertd_sync_fn sync;
  char error[160];  // the failed step and the driver's code, after a return of -1
};

static int failed(expertd_graph_call_plan* p, const char* what, int rc) {
  snprintf(p->error, sizeof(p->error), "%s failed: CUresult %d", what, rc);
  return -1;
}

// Run one call of m tokens (1 <= m <= rows, 1 <= k <= top_k) on `graph_exec`:
//   ids_src, weights_src  the call's routes [m, k] (int32, fp32), e.g. a client's slot
//   x_src, out_dst        device addresses of its x rows and of where its rows go (16-byte
//                         aligned)
//   bell_addr             0, or a device address that gets bell_value once the rows are
//                         out (stream-ordered after them)
// -> 0: the rows are in out_dst; 1: an id out of range (nothing was queued);
//    2: the rows are out but a row's flag is set (NaN/Inf); -1: a driver call failed or
//    the call does not fit the plan (plan->error says which; the stream may hold part of
//    the call).
int expertd_graph_call(expertd_graph_call_plan* p, void* graph_exec, int m, int k,
                      const int32_t* ids_src, const float* weights_src,
                      unsigned long long x_src, unsigned long long out_dst,
                      unsigned long long bell_addr, uint32_t bell_value) {
  const int width = p->top_k;
  if (m < 1 || m > p->rows || k < 1 || k > width || ((x_src | out_dst) & 15u)) {
    snprintf(p->error, sizeof(p->error),
             "%d tokens x top-k %d outside the graph's %d x %d, or rows not 16-byte aligned", m,
             k, p->rows, width);
    return -1;
  }
  int32_t* ids = p->ids_host;
  float* w = p->weights_host;
  const uint32_t limit = (uint32_t)p->num_experts + 1u;  // id + 1 in [0, E]
  uint32_t bad = 0;
  for (int r = 0; r < m; ++r) {
    int32_t* ids_row = ids + (size_t)r * width;
    float* w_row = w + (size_t)r * width;
    memcpy(ids_row, ids_src + (size_t)r * k, sizeof(int32_t) * k);
    memcpy(w_row, weights_src + (size_t)r * k, sizeof(float) * k);
    for (int j = 0; j < k; ++j) bad |= (uint32_t)((uint32_t)ids_row[j] + 1u >= limit);
    for (int j = k; j < width; ++j) {
      ids_row[j] = -1;
      w_row[j] = 0.0f;
    }
  }
  if (bad) return 1;
  for (size_t i = (size_t)m * width; i < (size_t)p->rows * width; ++i) {
    ids[i] = -1;
    w[i] = 0.0f;
  }
  p->header->x_src = x_src;
  p->header->out_dst = out_dst;
  p->header->m = m;
  void* s = p->stream;
  int rc;
  if ((rc = p->launch(graph_exec, s))) return failed(p, "cuGraphLaunch", rc);
  if (bell_addr && (rc = p->write(s, bell_addr, bell_value, 0)))
    return failed(p, "cuStreamWriteValue32", rc);
  if ((rc = p->record(p->event, s))) return failed(p, "cuEventRecord", rc);
  if ((rc = p->sync(p->event))) return failed(p, "cuEventSynchronize", rc);
  const volatile uint8_t* flags = p->flags_host;  // the GPU wrote them: read them again
  for (int r = 0; r < m; ++r)
    if (flags[r]) return 2;
  return 0;
}

}  // extern "C"
