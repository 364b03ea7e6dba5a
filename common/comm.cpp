#include "common/comm.h"

#include "common/error.h"
#include "common/tensor_checks.h"

namespace cp {

std::string to_string(Backend backend) {
  switch (backend) {
    case Backend::Local: return "local";
    case Backend::Mpi: return "mpi";
    case Backend::Nccl: return "nccl";
  }
  return "?";
}

Backend parse_backend(const std::string& name) {
  if (name == "local") return Backend::Local;
  if (name == "mpi") return Backend::Mpi;
  if (name == "nccl") return Backend::Nccl;
  CP_FAIL("--backend: expected local, mpi or nccl, got '", name, "'");
}

void Request::wait() {
  if (!batch_) return;
  // Release the batch even if wait() throws, so that a second wait() does not wait again.
  std::unique_ptr<detail::PendingBatch> batch = std::move(batch_);
  batch->wait();
}

void Comm::check_peer(int peer, const char* what) const {
  CP_CHECK(peer >= 0 && peer < size(), what, ": peer must be in [0, ", size(), "), got ", peer);
}

void Comm::check_buffer(const torch::Tensor& tensor, const char* what) {
  CP_CHECK(tensor.defined(), what, ": tensor is undefined");
  CP_CHECK(tensor.is_contiguous(), what, ": tensor must be contiguous (shape ", tensor.sizes(),
           ", strides ", tensor.strides(), "); call .contiguous() first");
}

void Comm::sendrecv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor, int src) {
  start({P2POp::send(send_tensor, dst), P2POp::recv(recv_tensor, src)}).wait();
}

// The generic collectives below exchange whole tensors with every peer in one batch: N-1
// messages per rank, simple and exact. Reductions then run in rank order on every rank, so all
// ranks compute bit-identical results. Backends with native collectives override them.

torch::Tensor Comm::all_gather(const torch::Tensor& tensor) {
  check_buffer(tensor, "all_gather");
  check_same_on_every_rank(*this, tensor, "all_gather");
  std::vector<torch::Tensor> parts(size());
  std::vector<P2POp> ops;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank()) {
      parts[peer] = tensor;
      continue;
    }
    parts[peer] = torch::empty_like(tensor);
    ops.push_back(P2POp::send(tensor, peer));
    ops.push_back(P2POp::recv(parts[peer], peer));
  }
  start(ops).wait();
  return tensor.dim() == 0 ? torch::stack(parts) : torch::cat(parts, 0);
}

torch::Tensor Comm::reduce_scatter(const torch::Tensor& tensor) {
  check_buffer(tensor, "reduce_scatter");
  check_same_on_every_rank(*this, tensor, "reduce_scatter");
  CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size() == 0,
           "reduce_scatter: dim 0 must be divisible by the world size ", size(), ", got shape ",
           tensor.sizes());
  const std::vector<torch::Tensor> chunks = tensor.chunk(size(), 0);
  std::vector<torch::Tensor> received(size());
  std::vector<P2POp> ops;
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank()) {
      received[peer] = chunks[peer];
      continue;
    }
    received[peer] = torch::empty_like(chunks[rank()]);
    ops.push_back(P2POp::send(chunks[peer].contiguous(), peer));
    ops.push_back(P2POp::recv(received[peer], peer));
  }
  start(ops).wait();
  torch::Tensor sum = received[0].clone();
  for (int peer = 1; peer < size(); ++peer) sum.add_(received[peer]);
  return sum;
}

void Comm::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  check_buffer(tensor, "all_reduce");
  check_same_on_every_rank(*this, tensor, "all_reduce");
  const torch::Tensor stacked = all_gather(tensor.unsqueeze(0));  // [N, ...] in rank order
  torch::Tensor reduced = torch::empty_like(tensor);
  if (op == ReduceOp::Sum) {
    reduced.copy_(stacked[0]);
    for (int r = 1; r < size(); ++r) reduced.add_(stacked[r]);
  } else {
    reduced.copy_(std::get<0>(stacked.max(0)));
  }
  tensor.copy_(reduced);
}

void Comm::broadcast(torch::Tensor& tensor, int root) {
  check_buffer(tensor, "broadcast");
  check_peer(root, "broadcast (root)");
  check_same_on_every_rank(*this, tensor, "broadcast");
  if (rank() != root) {
    recv(tensor, root);
    return;
  }
  std::vector<P2POp> ops;
  for (int peer = 0; peer < size(); ++peer)
    if (peer != root) ops.push_back(P2POp::send(tensor, peer));
  start(ops).wait();
}

torch::Tensor Comm::all_to_all(const torch::Tensor& tensor) {
  check_buffer(tensor, "all_to_all");
  check_same_on_every_rank(*this, tensor, "all_to_all");
  CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size() == 0,
           "all_to_all: dim 0 must be divisible by the world size ", size(), ", got shape ", tensor.sizes());
  torch::Tensor result = torch::empty_like(tensor);
  const int64_t part = tensor.size(0) / size();  // slices along dim 0 of a contiguous tensor are contiguous
  std::vector<P2POp> ops;
  for (int peer = 0; peer < size(); ++peer) {
    const torch::Tensor outgoing = tensor.narrow(0, peer * part, part);
    torch::Tensor incoming = result.narrow(0, peer * part, part);
    if (peer == rank()) {
      incoming.copy_(outgoing);
      continue;
    }
    ops.push_back(P2POp::send(outgoing, peer));
    ops.push_back(P2POp::recv(incoming, peer));
  }
  start(ops).wait();
  return result;
}

void Comm::barrier() {
  torch::Tensor token = torch::zeros({1}, torch::kInt32);
  all_reduce(token, ReduceOp::Sum);
}

}  // namespace cp
