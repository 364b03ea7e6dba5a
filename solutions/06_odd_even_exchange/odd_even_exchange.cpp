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
  // BEGIN SOLUTION task 1: the naive ring
  // STUB: // TODO(lesson 06, task 1): comm.send to next, then comm.recv from prev; run the test and read the DeadlockError.
  // STUB: // README, "Task 1 — the naive ring".
  // STUB: (void)comm, (void)send, (void)recv, (void)next, (void)prev;
  // STUB: throw NotImplemented("lesson 06, task 1: the naive exchange");
  comm.send(send, next);
  comm.recv(recv, prev);
  // END SOLUTION
}

/// Task 2: even ranks send first, odd ranks receive first.
void odd_even(Comm& comm, const torch::Tensor& send, torch::Tensor& recv, int next, int prev) {
  // BEGIN SOLUTION task 2: the odd-even ring
  // STUB: // TODO(lesson 06, task 2): an even rank sends to next, then receives from prev; an odd rank the other way round.
  // STUB: // README, "Task 2 — odd-even" (and "Odd-even ordering": why an odd N works too).
  // STUB: (void)comm, (void)send, (void)recv, (void)next, (void)prev;
  // STUB: throw NotImplemented("lesson 06, task 2: the odd-even exchange");
  if (comm.rank() % 2 == 0) {
    comm.send(send, next);
    comm.recv(recv, prev);
  } else {
    comm.recv(recv, prev);
    comm.send(send, next);
  }
  // END SOLUTION
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
    // BEGIN SOLUTION task 3: the library's calls
    // STUB: // TODO(lesson 06, task 3): SendRecv with comm.sendrecv; Batched with one comm.start({…}).wait().
    // STUB: default: throw NotImplemented("lesson 06, task 3: sendrecv and batched exchanges");
    case ExchangeMethod::SendRecv: comm.sendrecv(send, next, recv, prev); return;
    case ExchangeMethod::Batched: comm.start({P2POp::send(send, next), P2POp::recv(recv, prev)}).wait(); return;
    // END SOLUTION
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
