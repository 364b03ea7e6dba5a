#include "common/tensor_checks.h"

#include <vector>

#include "common/error.h"

namespace cp {

DType kernel_dtype(const torch::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case torch::kFloat: return DType::Float32;
    case torch::kHalf: return DType::Float16;
    case torch::kBFloat16: return DType::BFloat16;
    default: CP_FAIL(arg, ": CUDA kernels take float32, float16 or bfloat16, got ", t.dtype());
  }
}

void check_defined(const torch::Tensor& t, const char* arg, int64_t min_dim) {
  CP_CHECK(t.defined(), arg, ": tensor is undefined");
  CP_CHECK(t.dim() >= min_dim, arg, ": expected at least ", min_dim, " dimension(s), got shape ", t.sizes());
}

void check_float_dtype(const torch::Tensor& t, const char* arg) {
  if (t.is_cuda()) {
    kernel_dtype(t, arg);
    return;
  }
  CP_CHECK(t.device().is_cpu(), arg, ": expected a CPU or CUDA tensor, got ", t.device());
  CP_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kDouble, arg,
           ": the CPU path takes float32 or float64, got ", t.dtype(),
           " (float16/bfloat16 are supported on CUDA; use .to(torch::kFloat) on the CPU)");
}

void check_same_on_every_rank(Comm& comm, const torch::Tensor& t, const std::string& arg, const std::string& hint) {
  CP_CHECK(t.defined(), arg, ": tensor is undefined");
  // [dim, sizes..., dtype], padded with -1 to a fixed length so that every message has one size.
  constexpr int64_t kMaxDims = 8, kFields = kMaxDims + 2;
  CP_CHECK(t.dim() <= kMaxDims, arg, ": at most ", kMaxDims, " dimensions are supported, got ", t.sizes());
  std::vector<int64_t> mine(kFields, -1);
  mine[0] = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) mine[d + 1] = t.size(d);
  mine[kFields - 1] = static_cast<int64_t>(t.scalar_type());
  // On t's device: the nccl backend only moves GPU tensors.
  const torch::Tensor descriptor = torch::tensor(mine, torch::kLong).to(t.device());
  std::vector<torch::Tensor> theirs(comm.size());
  std::vector<P2POp> ops;
  for (int peer = 0; peer < comm.size(); ++peer) {
    if (peer == comm.rank()) continue;
    theirs[peer] = torch::empty_like(descriptor);
    ops.push_back(P2POp::send(descriptor, peer));
    ops.push_back(P2POp::recv(theirs[peer], peer));
  }
  comm.start(ops).wait();
  for (int peer = 0; peer < comm.size(); ++peer) {
    if (peer == comm.rank()) continue;
    const torch::Tensor row = theirs[peer].cpu();
    if (torch::equal(row, descriptor.cpu())) continue;
    const int64_t* f = row.data_ptr<int64_t>();
    // Every rank differs from some other rank, so every rank throws here: nobody waits.
    throw ErrorOnEveryRank(detail::concat(arg, ": every rank must pass the same shape and dtype; rank ", comm.rank(),
                                          " has ", t.sizes(), " ", t.scalar_type(), ", rank ", peer, " has ",
                                          torch::IntArrayRef(f + 1, f[0]), " ", c10::ScalarType(f[kFields - 1]),
                                          hint.empty() ? "" : ". ", hint),
                           __FILE__, __LINE__);
  }
}

std::vector<std::vector<int64_t>> agree_on_every_rank(Comm& comm, torch::Device device, const std::string& error,
                                                      std::vector<int64_t> fields) {
  constexpr int64_t kFields = 16, kMessage = 240;  // a message longer than kMessage is cut
  CP_CHECK(static_cast<int64_t>(fields.size()) <= kFields, "agree_on_every_rank: at most ", kFields, " fields, got ",
           fields.size());
  fields.resize(kFields, 0);
  std::vector<int64_t> row = fields;
  row.push_back(error.empty() ? 0 : 1);
  for (int64_t i = 0; i < kMessage; ++i)
    row.push_back(i < static_cast<int64_t>(error.size()) ? static_cast<unsigned char>(error[i]) : 0);
  const int64_t width = static_cast<int64_t>(row.size());
  const torch::Tensor all = comm.all_gather(torch::tensor(row, torch::kLong).to(device)).cpu().view({comm.size(), width});
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> every(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t* f = a + r * width;
    if (f[kFields] != 0) {
      std::string message;
      for (int64_t i = 0; i < kMessage && f[kFields + 1 + i]; ++i) message += static_cast<char>(f[kFields + 1 + i]);
      throw ErrorOnEveryRank(r == comm.rank() ? message : detail::concat("rank ", r, ": ", message), __FILE__, __LINE__);
    }
    every[r].assign(f, f + kFields);
  }
  return every;
}

}  // namespace cp
