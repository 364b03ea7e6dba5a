// Lesson 06 — the deadlock-free ring exchange: the contract the tests use.
//
// Every rank sends `send` to (r+1) mod N and receives `recv` from (r−1) mod N. With blocking,
// rendezvous send/recv the obvious order deadlocks; this lesson orders the calls so that it
// cannot, compares with the library's combined and batched calls, and plugs the result into
// the ring attention of lessons 04 and 05. The learner writes odd_even_exchange.cpp.
#pragma once

#include <torch/types.h>

#include <string>

#include "common/comm.h"
#include "ring_attention.h"

namespace cp {

enum class ExchangeMethod {
  Naive,     ///< everyone sends, then receives (blocking): deadlocks for N ≥ 2
  OddEven,   ///< even ranks send then receive, odd ranks receive then send (blocking)
  SendRecv,  ///< Comm::sendrecv, the library's combined call
  Batched    ///< one batch of non-blocking send + receive (Comm::start), what NCCL requires
};

std::string to_string(ExchangeMethod how);

/// Sends `send` to rank (r+1) mod N and receives into `recv` from rank (r−1) mod N, `how`.
/// `recv` must have send's shape and dtype (a cp::Error otherwise). N = 1 is a copy (a rank is
/// its own neighbour). Returns when both are complete.
void ring_exchange(Comm& comm, const torch::Tensor& send, torch::Tensor& recv, ExchangeMethod how);

/// The ring attention hook (RingOptions::exchange) for `how`: each tensor pair is exchanged in
/// turn with ring_exchange. Naive is refused with a cp::Error: it would deadlock.
RingExchange ring_exchange_for(ExchangeMethod how);

}  // namespace cp
