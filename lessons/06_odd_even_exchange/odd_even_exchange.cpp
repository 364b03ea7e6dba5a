// GENERATED from solutions/06_odd_even_exchange/odd_even_exchange.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 06 — four ways to pass a tensor one step around the ring.
#include "odd_even_exchange.h"

#include "common/error.h"

namespace cp {

std::string to_string(ExchangeMethod how) {
  switch (how) {
    case ExchangeMethod::Naive: return "naive";
    case ExchangeMethod::OddEven: return "odd-even";
    case ExchangeMethod::SendRecv: return "sendrecv";
    case ExchangeMethod::Batched: return "batched";
  }
  return "?";
}

namespace {

/// Task 1: every rank sends, then receives, with blocking calls.
void naive(Comm& comm, const torch::Tensor& send, torch::Tensor& recv, int next, int prev) {
  // BEGIN YOUR CODE task 1: the naive ring
  // TODO(lesson 06, task 1): comm.send to next, then comm.recv from prev; run the test and read the DeadlockError.
  // README, "Task 1 — the naive ring".
  (void)comm, (void)send, (void)recv, (void)next, (void)prev;
  throw NotImplemented("lesson 06, task 1: the naive exchange");
  // END YOUR CODE
}

/// Task 2: even ranks send first, odd ranks receive first.
void odd_even(Comm& comm, const torch::Tensor& send, torch::Tensor& recv, int next, int prev) {
  // BEGIN YOUR CODE task 2: the odd-even ring
  // TODO(lesson 06, task 2): an even rank sends to next, then receives from prev; an odd rank the other way round.
  // README, "Task 2 — odd-even" (and "Odd-even ordering": why an odd N works too).
  (void)comm, (void)send, (void)recv, (void)next, (void)prev;
  throw NotImplemented("lesson 06, task 2: the odd-even exchange");
  // END YOUR CODE
}

}  // namespace

void ring_exchange(Comm& comm, const torch::Tensor& send, torch::Tensor& recv, ExchangeMethod how) {
  CP_CHECK(send.defined() && recv.defined(), "ring_exchange: send and recv must be defined tensors");
  // In a ring every rank sends the same shape, so what arrives has send's shape; at N = 1 the
  // copy below would otherwise broadcast or convert instead of failing.
  CP_CHECK(recv.sizes() == send.sizes() && recv.scalar_type() == send.scalar_type(),
           "ring_exchange: recv must have send's shape and dtype (", send.sizes(), " ", send.dtype(), "), got ",
           recv.sizes(), " ", recv.dtype());
  const int n = comm.size(), next = (comm.rank() + 1) % n, prev = (comm.rank() - 1 + n) % n;
  if (n == 1) {  // one rank is its own neighbour; a blocking send to oneself would wait forever
    recv.copy_(send);
    return;
  }
  switch (how) {
    case ExchangeMethod::Naive: naive(comm, send, recv, next, prev); return;
    case ExchangeMethod::OddEven: odd_even(comm, send, recv, next, prev); return;
    // BEGIN YOUR CODE task 3: the library's calls
    // TODO(lesson 06, task 3): SendRecv with comm.sendrecv; Batched with one comm.start({…}).wait().
    default: throw NotImplemented("lesson 06, task 3: sendrecv and batched exchanges");
    // END YOUR CODE
  }
}

RingExchange ring_exchange_for(ExchangeMethod how) {
  CP_CHECK(how != ExchangeMethod::Naive, "ring_exchange_for: the naive exchange deadlocks for N >= 2; use OddEven, "
                                   "SendRecv or Batched");
  return [how](Comm& comm, const std::vector<torch::Tensor>& outgoing, const std::vector<torch::Tensor>& incoming) {
    CP_CHECK(outgoing.size() == incoming.size(), "ring exchange: ", outgoing.size(), " tensors to send but ",
             incoming.size(), " to receive");
    for (size_t i = 0; i < outgoing.size(); ++i) {
      torch::Tensor target = incoming[i];
      ring_exchange(comm, outgoing[i], target, how);
    }
    return Request();  // complete already: nothing left in flight
  };
}

}  // namespace cp
