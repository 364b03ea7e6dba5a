// A Comm that the tests own, between a lesson's code and the real one: it counts the bytes the
// code sends, so that a test compares them with a formula instead of trusting a count the code
// reports about itself, and it records each batch of point-to-point operations as a span on the
// "comm" lane of a Trace, from start() to the end of wait(), so that a test can see whether the
// code computed while its messages were in flight.
#pragma once

#include "common/comm.h"
#include "common/trace.h"

namespace cp::testing {

/// Bytes counted: every point-to-point send (its tensor's bytes); the floating-point payload of
/// the collectives as the course's formulas count it (all_gather: the tensor to each of the
/// N − 1 others; broadcast: the root's tensor to each of the N − 1 others; all_to_all: every part
/// of the tensor but the rank's own). Integer collectives are not counted: they are the given
/// checks' agreement on shapes and counts, not data.
class CountingComm : public Comm {
 public:
  /// `trace` (may be null): where the spans of start()…wait() go, under this rank.
  explicit CountingComm(Comm& inner, Trace* trace = nullptr) : inner_(inner), trace_(trace) {}
  int64_t bytes_sent() const { return bytes_sent_; }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }
  void send(const torch::Tensor& tensor, int peer) override;
  void recv(torch::Tensor& tensor, int peer) override { inner_.recv(tensor, peer); }
  Request start(const std::vector<P2POp>& ops) override;
  torch::Tensor all_gather(const torch::Tensor& tensor) override;
  void broadcast(torch::Tensor& tensor, int root) override;
  torch::Tensor reduce_scatter(const torch::Tensor& tensor) override { return inner_.reduce_scatter(tensor); }
  void all_reduce(torch::Tensor& tensor, ReduceOp op) override { inner_.all_reduce(tensor, op); }
  void barrier() override { inner_.barrier(); }
  torch::Tensor all_to_all(const torch::Tensor& tensor) override;
  std::shared_ptr<Comm> split(int color, int key) override { return inner_.split(color, key); }

 private:
  Comm& inner_;
  Trace* trace_;
  int64_t bytes_sent_ = 0;
};

}  // namespace cp::testing
