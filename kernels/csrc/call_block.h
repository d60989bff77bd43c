// The start of a lane call's block: host memory mapped into the GPU's address space, written
// by the host before a call's graph launches (kernels/csrc/graph_call.cu) and read by the
// graph's first and last kernels (kernels/csrc/rows.cu). 64 bytes; the call's routes follow
// (ids int32 [capacity, top_k], then weights fp32 [capacity, top_k]), then one NaN/Inf flag
// byte per row, written by the graph.
#pragma once

extern "C" {

struct expertd_call_header {
  unsigned long long x_src;    // device address of the call's x rows (bf16 [m, H])
  unsigned long long out_dst;  // device address its output rows go to (bf16 [m, H])
  int m;                       // the call's tokens (<= the graph's rows)
  int pad_[11];
};

}  // extern "C"
