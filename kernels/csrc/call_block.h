// The start of a lane call's block: host memory mapped into the GPU's address space, written
// by the host before a call's graph launches (kernels/csrc/graph_call.cu) and copied by the
// graph into its device mirror, which its first and last kernels read (kernels/csrc/rows.cu).
// 64 bytes; the call's routes follow, for a graph of `rows` tokens ids int32 [rows, top_k]
// then weights fp32 [rows, top_k], so that one copy of 64 + 8 rows top_k bytes carries a
// call (room for `capacity` rows of both); at 64 + 8 capacity top_k, one NaN/Inf flag byte
// per row, written by the graph's last kernel.
#pragma once

extern "C" {

struct expertd_call_header {
  unsigned long long x_src;    // device address of the call's x rows (bf16 [m, H])
  unsigned long long out_dst;  // device address its output rows go to (bf16 [m, H])
  int m;                       // the call's tokens (<= the graph's rows)
  int pad_[11];
};

}  // extern "C"
