// Argument checks shared by the public functions: each error names the argument, what was
// expected and what came.
#pragma once

#include <torch/types.h>

#include <string>

#include "common/comm.h"
#include "common/dtype.h"

namespace cp {

/// The kernel element type of a CUDA tensor; a cp::Error naming `arg` for other dtypes.
DType kernel_dtype(const torch::Tensor& t, const char* arg);

/// `arg` is defined and has at least `min_dim` dimensions.
void check_defined(const torch::Tensor& t, const char* arg, int64_t min_dim = 0);

/// The dtypes a function accepts, per device: CPU float32/float64, CUDA float32/float16/bfloat16
/// (the course's kernels compute in float32 whatever the input).
void check_float_dtype(const torch::Tensor& t, const char* arg);

/// Every rank of `comm` passes a tensor of t's shape and dtype, or every rank throws a
/// cp::ErrorOnEveryRank naming `arg`, both ranks and both shapes (followed by `hint`, e.g. "Is S
/// divisible by N?"). A collective call: every rank must make it. The check moves a small fixed-
/// size descriptor by point-to-point messages, so that the collectives themselves can use it:
/// ranks that disagree on a shape would otherwise hang (MPI, NCCL) or reinterpret rows.
void check_same_on_every_rank(Comm& comm, const torch::Tensor& t, const std::string& arg,
                              const std::string& hint = {});

/// Every rank's `fields` (at most 16 numbers, padded with 0) and its `error` ("" when its inputs
/// are good), in one all-gather of a fixed-size row on `device` (the nccl backend moves GPU
/// tensors only). If any rank has an error, every rank throws a cp::ErrorOnEveryRank with the first
/// one (prefixed "rank r: " on the other ranks), so that nobody goes on to wait for a message;
/// otherwise returns the fields of every rank, in rank order. A collective call.
std::vector<std::vector<int64_t>> agree_on_every_rank(Comm& comm, torch::Device device, const std::string& error,
                                                      std::vector<int64_t> fields);

}  // namespace cp
