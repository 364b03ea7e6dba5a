// Lesson 02 — distributed ring softmax: the contract the tests use.
//
// Each row of x is split along its columns (the softmax dimension) over the ranks of `comm`,
// contiguously: rank r holds columns [offset_r, offset_r + n_r). Every rank returns the softmax
// of its own shard, normalised over the *whole* row. The learner writes ring_softmax.cpp.
#pragma once

#include <torch/types.h>

#include "common/comm.h"

namespace cp {

/// How the ranks agree on each row's global (m, l) state.
enum class RingSoftmaxAlgo {
  Chain,        ///< 0 → 1 → … → N−1 pass the running state on; N−1 broadcasts the result
  Ring,         ///< every rank's state travels N−1 hops around the ring; no broadcast
  TwoAllReduce  ///< all_reduce(max), then all_reduce(sum of exp(x − m)): what NCCL can do
};

/// Softmax states of many rows, as two float32 tensors of the rows' shape: m (the maximum) and
/// l = Σ exp(x − m). An empty row (or a row of −inf only) is {−inf, 0}.
struct RowStates {
  torch::Tensor m;  ///< [rows...] float32
  torch::Tensor l;  ///< [rows...] float32
};

/// The state of every row of x over its last dimension (x may have 0 columns).
RowStates local_row_states(const torch::Tensor& x);

/// Row-wise merge of two sets of states (lesson 01's merge on tensors), −inf-safe.
RowStates merge_row_states(const RowStates& a, const RowStates& b);

/// softmax over the full row of this rank's shard.
/// @param x_local  [rows..., n_r] this rank's columns; CPU float32/float64 or CUDA
///                 float32/float16/bfloat16. The shard widths n_r may differ between ranks
///                 (0 included); the leading (row) dimensions must be equal on every rank.
/// @return         [rows..., n_r] same dtype and device; a row that is −inf on every rank gives 0.
torch::Tensor ring_softmax(Comm& comm, const torch::Tensor& x_local, RingSoftmaxAlgo algo);

}  // namespace cp
