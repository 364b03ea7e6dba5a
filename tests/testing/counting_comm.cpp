#include "testing/counting_comm.h"

#include <memory>

namespace cp::testing {
namespace {

int64_t bytes_of(const torch::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

/// The inner batch, and its span on the trace once waited for.
class TracedBatch : public detail::PendingBatch {
 public:
  TracedBatch(Request inner, Trace* trace, int rank)
      : inner_(std::move(inner)), trace_(trace), rank_(rank), start_(Trace::Clock::now()) {}
  void wait() override {
    inner_.wait();
    if (trace_) trace_->add(rank_, "comm", "start…wait", start_, Trace::Clock::now());
  }

 private:
  Request inner_;
  Trace* trace_;
  int rank_;
  Trace::Clock::time_point start_;
};

}  // namespace

void CountingComm::send(const torch::Tensor& tensor, int peer) {
  inner_.send(tensor, peer);
  bytes_sent_ += bytes_of(tensor);
}

Request CountingComm::start(const std::vector<P2POp>& ops) {
  for (const P2POp& op : ops)
    if (op.kind == P2POp::Kind::Send) bytes_sent_ += bytes_of(op.tensor);
  return Request(std::make_unique<TracedBatch>(inner_.start(ops), trace_, rank()));
}

torch::Tensor CountingComm::all_gather(const torch::Tensor& tensor) {
  if (tensor.is_floating_point()) bytes_sent_ += (size() - 1) * bytes_of(tensor);
  return inner_.all_gather(tensor);
}

torch::Tensor CountingComm::all_to_all(const torch::Tensor& tensor) {
  // Every part but this rank's own goes out.
  if (tensor.is_floating_point() && tensor.dim() > 0) bytes_sent_ += bytes_of(tensor) / size() * (size() - 1);
  return inner_.all_to_all(tensor);
}

void CountingComm::broadcast(torch::Tensor& tensor, int root) {
  if (tensor.is_floating_point() && rank() == root) bytes_sent_ += (size() - 1) * bytes_of(tensor);
  inner_.broadcast(tensor, root);
}

}  // namespace cp::testing
