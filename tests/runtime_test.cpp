// Tests of the course runtime itself: every P2P pattern and collective of cp::Comm against
// expected values (local worlds of 1, 2, 3, 4, 8 ranks, or the mpirun world), the deadlock
// watchdog, failure propagation, bad arguments, and the test oracle's own comparison.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include <cmath>
#include <map>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/memory_meter.h"
#include "common/world.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::for_each_world;

/// A tensor that says who made it: value = 100 * rank + index.
torch::Tensor rank_tensor(int rank, int64_t n, torch::ScalarType dtype = torch::kFloat) {
  return (torch::arange(n, torch::kDouble) + 100.0 * rank).to(dtype);
}

void expect_equal(const torch::Tensor& actual, const torch::Tensor& expected, const std::string& what) {
  EXPECT_TRUE(torch::equal(actual, expected)) << what << ": got " << actual << "\nexpected " << expected;
}

const std::vector<torch::ScalarType> kP2PDtypes = {torch::kFloat, torch::kDouble, torch::kHalf, torch::kLong};

CP_TEST(Runtime, BatchedRingShiftDeliversThePreviousRanksTensor) {
  for_each_world([](Comm& comm) {
    const int next = (comm.rank() + 1) % comm.size(), prev = (comm.rank() + comm.size() - 1) % comm.size();
    for (auto dtype : kP2PDtypes) {
      torch::Tensor incoming = torch::empty({5}, dtype);
      comm.start({P2POp::send(rank_tensor(comm.rank(), 5, dtype), next), P2POp::recv(incoming, prev)}).wait();
      expect_equal(incoming, rank_tensor(prev, 5, dtype), "ring shift");
    }
  });
}

CP_TEST(Runtime, SendRecvShiftsBothDirections) {
  for_each_world([](Comm& comm) {
    const int n = comm.size(), r = comm.rank();
    for (int shift : {1, n - 1, 2 % n}) {
      torch::Tensor incoming = torch::empty({3, 2});
      comm.sendrecv(rank_tensor(r, 6).view({3, 2}), (r + shift) % n, incoming, (r - shift + n) % n);
      expect_equal(incoming, rank_tensor((r - shift + n) % n, 6).view({3, 2}), "sendrecv");
    }
  });
}

CP_TEST(Runtime, BlockingSendRecvInPairs) {
  // Even ranks send to the odd rank above them, which answers: blocking calls in a safe order.
  for_each_world([](Comm& comm) {
    const int r = comm.rank();
    if (r % 2 == 0 && r + 1 < comm.size()) {
      comm.send(rank_tensor(r, 4), r + 1);
      torch::Tensor answer = torch::empty({4});
      comm.recv(answer, r + 1);
      expect_equal(answer, rank_tensor(r + 1, 4), "answer");
    } else if (r % 2 == 1) {
      torch::Tensor question = torch::empty({4});
      comm.recv(question, r - 1);
      expect_equal(question, rank_tensor(r - 1, 4), "question");
      comm.send(rank_tensor(r, 4), r - 1);
    }
  });
}

CP_TEST(Runtime, MessagesBetweenTwoRanksArriveInOrder) {
  for_each_world([](Comm& comm) {
    if (comm.size() < 2 || comm.rank() > 1) return;
    const int peer = 1 - comm.rank();
    std::vector<torch::Tensor> inbox;
    std::vector<P2POp> ops;
    for (int i = 0; i < 4; ++i) {
      inbox.push_back(torch::empty({2}));
      ops.push_back(P2POp::send(torch::full({2}, 10.0 * comm.rank() + i), peer));
      ops.push_back(P2POp::recv(inbox.back(), peer));
    }
    comm.start(ops).wait();
    for (int i = 0; i < 4; ++i) expect_equal(inbox[i], torch::full({2}, 10.0 * peer + i), "message " + std::to_string(i));
  });
}

CP_TEST(Runtime, AllGatherConcatenatesInRankOrder) {
  for_each_world([](Comm& comm) {
    const torch::Tensor gathered = comm.all_gather(rank_tensor(comm.rank(), 6).view({2, 3}));
    std::vector<torch::Tensor> expected;
    for (int r = 0; r < comm.size(); ++r) expected.push_back(rank_tensor(r, 6).view({2, 3}));
    expect_equal(gathered, torch::cat(expected, 0), "all_gather");
  });
}

CP_TEST(Runtime, ReduceScatterSumsAndSplits) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    const torch::Tensor mine = rank_tensor(comm.rank(), 2 * n * 3).view({2 * n, 3});
    torch::Tensor total = torch::zeros({2 * n, 3});
    for (int r = 0; r < n; ++r) total += rank_tensor(r, 2 * n * 3).view({2 * n, 3});
    expect_equal(comm.reduce_scatter(mine), total.chunk(n, 0)[comm.rank()], "reduce_scatter");
  });
}

CP_TEST(Runtime, AllReduceSumAndMax) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
      torch::Tensor sum = rank_tensor(comm.rank(), 7, dtype);
      comm.all_reduce(sum, ReduceOp::Sum);
      torch::Tensor expected = torch::zeros({7}, dtype);
      for (int r = 0; r < n; ++r) expected += rank_tensor(r, 7, dtype);
      expect_equal(sum, expected, "all_reduce sum");

      // The maximum comes from a different rank for different elements.
      torch::Tensor mx = torch::arange(7, dtype).remainder(n).eq(comm.rank()).to(dtype) * (comm.rank() + 1);
      comm.all_reduce(mx, ReduceOp::Max);
      expect_equal(mx, torch::arange(7, dtype).remainder(n) + 1, "all_reduce max");
    }
  });
}

/// float16 and bfloat16 tensors on `device` are reduced too (lesson 09's all_reduce_gradients of
/// a bfloat16 layer): the local backend adds in the dtype, the mpi backend in float32 (MPI has no
/// half type), NCCL in its own way.
void expect_half_precision_reductions(torch::Device device) {
  for_each_world([device](Comm& comm) {
    const int n = comm.size();
    for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
      auto values_of = [&](int rank) {  // rank's tensor, on the CPU: any rank can make any rank's
        torch::Generator gen = at::detail::createCPUGenerator(500 + rank);
        return (torch::randn({2 * n, 33}, gen) * 10).to(dtype);
      };
      torch::Tensor exact = torch::zeros({2 * n, 33}, torch::kDouble), magnitude = exact.clone(), mx;
      for (int r = 0; r < n; ++r) {
        const torch::Tensor x = values_of(r).to(torch::kDouble);
        exact += x;
        magnitude += x.abs();
        mx = r == 0 ? x : torch::maximum(mx, x);
      }
      // Each of the N − 1 additions in the dtype rounds with a relative error of at most u (2^-11
      // for float16, 2^-8 for bfloat16), so |error| <= (N − 1)·u·Σ|x_r| (to first order); float32
      // additions and one rounding to the dtype stay below u·Σ|x_r| + (N − 1)·2^-24·Σ|x_r|. N·u·Σ|x_r|
      // bounds both, and is far below what a lost or doubled rank would add (about |x_r|, ~10).
      const double u = dtype == torch::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
      const torch::Tensor tolerance = n * u * magnitude;
      const std::string what = std::string(c10::toString(dtype)) + " on " + device.str() + ", rank " +
                               std::to_string(comm.rank());

      torch::Tensor sum = values_of(comm.rank()).to(device);
      comm.all_reduce(sum, ReduceOp::Sum);
      ASSERT_EQ(sum.scalar_type(), dtype) << what;
      ASSERT_EQ(sum.device().type(), device.type()) << what;
      EXPECT_TRUE(((sum.cpu().to(torch::kDouble) - exact).abs() <= tolerance).all().item<bool>())
          << "all_reduce sum, " << what << ": got\n" << sum << "\nexpected\n" << exact;

      const torch::Tensor part = comm.reduce_scatter(values_of(comm.rank()).to(device));
      ASSERT_EQ(part.scalar_type(), dtype) << what;
      ASSERT_EQ(part.device().type(), device.type()) << what;
      ASSERT_EQ(part.sizes(), torch::IntArrayRef({2, 33})) << what;
      const torch::Tensor my_rows = exact.chunk(n, 0)[comm.rank()];
      EXPECT_TRUE(
          ((part.cpu().to(torch::kDouble) - my_rows).abs() <= tolerance.chunk(n, 0)[comm.rank()]).all().item<bool>())
          << "reduce_scatter, " << what << ": got\n" << part << "\nexpected\n" << my_rows;

      torch::Tensor largest = values_of(comm.rank()).to(device);
      comm.all_reduce(largest, ReduceOp::Max);
      expect_equal(largest.cpu().to(torch::kDouble), mx, "all_reduce max (exact in any dtype), " + what);
    }
  });
}

CP_TEST(Runtime, HalfPrecisionReductionsMatchAFloat64Sum) { expect_half_precision_reductions(torch::kCPU); }

CP_TEST(RuntimeCuda, HalfPrecisionReductionsMatchAFloat64Sum) {
  CP_REQUIRE_GPU();
  expect_half_precision_reductions(torch::kCUDA);  // the current device: under mpirun, this rank's GPU
}

CP_TEST(Runtime, BroadcastFromEveryRoot) {
  for_each_world([](Comm& comm) {
    for (int root = 0; root < comm.size(); ++root) {
      torch::Tensor t = comm.rank() == root ? rank_tensor(root, 4) : torch::zeros({4});
      comm.broadcast(t, root);
      expect_equal(t, rank_tensor(root, 4), "broadcast from " + std::to_string(root));
    }
  });
}

CP_TEST(Runtime, BarrierWaitsForEveryRank) {
  for_each_world([](Comm& comm) {
    // Each rank announces its arrival before the barrier; after it, every announcement is in.
    torch::Tensor arrived = torch::zeros({comm.size()}, torch::kInt32);
    arrived[comm.rank()] = 1;
    comm.barrier();
    comm.all_reduce(arrived, ReduceOp::Sum);
    EXPECT_EQ(arrived.sum().item<int>(), comm.size());
  });
}

CP_TEST(Runtime, AllToAllSendsPartPToRankP) {
  for_each_world([](Comm& comm) {
    const int n = comm.size();
    for (auto dtype : kP2PDtypes) {
      // Part p of rank r holds 100·r + 10·p (+ index): it must arrive as part r of rank p.
      auto part = [&](int sender, int p) { return (rank_tensor(sender, 6, dtype) + 10 * p).view({2, 3}); };
      std::vector<torch::Tensor> mine, expected;
      for (int p = 0; p < n; ++p) {
        mine.push_back(part(comm.rank(), p));
        expected.push_back(part(p, comm.rank()));
      }
      expect_equal(comm.all_to_all(torch::cat(mine, 0)), torch::cat(expected, 0), "all_to_all");
    }
    const torch::Tensor empty = torch::zeros({0, 3});
    EXPECT_EQ(comm.all_to_all(empty).sizes(), empty.sizes());
  });
}

CP_TEST(Runtime, SplitGroupsRanksByColorInKeyOrder) {
  for_each_world([](Comm& comm) {
    // Two colors (uneven groups when the world is odd), ranked in reverse by the key.
    const int color = comm.rank() % 2;
    const std::shared_ptr<Comm> sub = comm.split(color, -comm.rank());
    std::vector<int64_t> members;  // world ranks of my color, highest first
    for (int r = comm.size() - 1; r >= 0; --r)
      if (r % 2 == color) members.push_back(r);
    ASSERT_EQ(sub->size(), static_cast<int>(members.size()));
    EXPECT_EQ(members[sub->rank()], comm.rank());
    expect_equal(sub->all_gather(torch::tensor({static_cast<int64_t>(comm.rank())})), torch::tensor(members),
                 "world ranks of the sub-communicator, in its rank order");

    // Point-to-point and the personalised exchange use the sub-communicator's own ranks.
    const int next = (sub->rank() + 1) % sub->size(), prev = (sub->rank() + sub->size() - 1) % sub->size();
    torch::Tensor incoming = torch::empty({3});
    sub->sendrecv(rank_tensor(comm.rank(), 3), next, incoming, prev);
    expect_equal(incoming, rank_tensor(static_cast<int>(members[prev]), 3), "ring shift inside the sub-communicator");
    const torch::Tensor parts = torch::full({sub->size()}, comm.rank(), torch::kLong);
    expect_equal(sub->all_to_all(parts), torch::tensor(members), "all_to_all inside the sub-communicator");

    // A split of a split: every rank alone.
    const std::shared_ptr<Comm> single = sub->split(sub->rank(), 0);
    EXPECT_EQ(single->size(), 1);
    EXPECT_EQ(single->rank(), 0);
  });
}

CP_TEST(Runtime, TwoCommunicatorsOverTheSameRanksNeverMixTheirMessages) {
  for_each_world([](Comm& comm) {
    const std::shared_ptr<Comm> a = comm.split(0, comm.rank());
    const std::shared_ptr<Comm> b = comm.split(0, comm.rank());  // the same ranks, another communicator
    const int n = comm.size(), next = (comm.rank() + 1) % n, prev = (comm.rank() + n - 1) % n;
    // Receives are posted A first, sends B first: B's message must not land in A's receive.
    torch::Tensor on_a = torch::empty({4}), on_b = torch::empty({4});
    Request recv_a = a->start({P2POp::recv(on_a, prev)});
    Request recv_b = b->start({P2POp::recv(on_b, prev)});
    Request send_b = b->start({P2POp::send(rank_tensor(comm.rank(), 4) + 2000, next)});
    torch::Tensor sum_b = torch::ones({1});
    b->all_reduce(sum_b, ReduceOp::Sum);  // a collective on B while A's receive is in flight
    Request send_a = a->start({P2POp::send(rank_tensor(comm.rank(), 4) + 1000, next)});
    for (Request* r : {&recv_a, &recv_b, &send_b, &send_a}) r->wait();
    expect_equal(on_a, rank_tensor(prev, 4) + 1000, "message on A");
    expect_equal(on_b, rank_tensor(prev, 4) + 2000, "message on B");
    EXPECT_EQ(sum_b.item<float>(), n);

    // Rows and columns of a mesh at once: each rank reduces over both, interleaved.
    const int cols = n % 2 == 0 ? 2 : 1;
    const std::shared_ptr<Comm> row = comm.split(comm.rank() / cols, comm.rank());
    const std::shared_ptr<Comm> col = comm.split(comm.rank() % cols, comm.rank());
    torch::Tensor over_row = torch::full({2}, static_cast<double>(comm.rank()), torch::kDouble);
    torch::Tensor over_col = over_row.clone();
    row->all_reduce(over_row, ReduceOp::Max);
    col->all_reduce(over_col, ReduceOp::Sum);
    const int row_last = (comm.rank() / cols) * cols + cols - 1;
    double col_sum = 0;
    for (int r = comm.rank() % cols; r < n; r += cols) col_sum += r;
    EXPECT_EQ(over_row[0].item<double>(), row_last);
    EXPECT_EQ(over_col[0].item<double>(), col_sum);
  });
}

CP_TEST(Runtime, BadArgumentsGiveClearErrors) {
  for_each_world([](Comm& comm) {
    torch::Tensor t = torch::zeros({4});
    testing::expect_error([&] { comm.send(t, comm.size()); }, "peer must be in [0, " + std::to_string(comm.size()) + ")");
    testing::expect_error([&] { comm.start({P2POp::recv(t, -1)}); }, "peer must be in");
    testing::expect_error([&] { comm.send(torch::zeros({4, 4}).t(), 0); }, "must be contiguous");
    if (comm.size() > 1)
      testing::expect_error([&] { comm.reduce_scatter(torch::zeros({comm.size() + 1})); }, "divisible by the world size");
    testing::expect_error([&] { comm.broadcast(t, -2); }, "root");
    if (comm.size() > 1)
      testing::expect_error([&] { comm.all_to_all(torch::zeros({comm.size() + 1})); }, "divisible by the world size");
    testing::expect_error([&] { comm.split(-1, 0); }, "color must be >= 0");
  });
}

// ── local backend: mismatches, the watchdog, failure propagation ───────────────────────────────

CP_TEST(LocalBackend, MismatchedSendAndReceiveAreReportedOnBothSides) {
  for (auto [recv_numel, recv_dtype] : {std::pair{3, torch::kFloat}, std::pair{4, torch::kDouble}}) {
    try {
      run_local_world(2, [&](Comm& comm) {
        if (comm.rank() == 0) {
          comm.send(torch::zeros({4}), 1);
        } else {
          torch::Tensor t = torch::zeros({recv_numel}, recv_dtype);
          comm.recv(t, 0);
        }
      });
      ADD_FAILURE() << "a mismatched send/recv must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("send/recv mismatch: rank 0 sends 4 float elements"), std::string::npos)
          << e.what();
    }
  }
}

CP_TEST(LocalBackend, WatchdogNamesTheCycleOfANaiveBlockingRing) {
  for (int n : {2, 3, 5}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      run_local_world(
          n,
          [](Comm& comm) {
            // Every rank sends first: with rendezvous sends nobody ever reaches its receive.
            comm.send(torch::ones({8}), (comm.rank() + 1) % comm.size());
            torch::Tensor t = torch::empty({8});
            comm.recv(t, (comm.rank() + comm.size() - 1) % comm.size());
          },
          {std::chrono::milliseconds(200)});
      ADD_FAILURE() << "a naive blocking ring of " << n << " ranks must deadlock";
    } catch (const DeadlockError& e) {
      const std::string what = e.what();
      for (int r = 0; r < n; ++r) {
        const std::string edge = "rank " + std::to_string(r) + " send→" + std::to_string((r + 1) % n);
        EXPECT_NE(what.find(edge), std::string::npos) << "missing '" << edge << "' in: " << what;
      }
      EXPECT_NE(what.find("Wait-for cycle"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
}

CP_TEST(LocalBackend, WatchdogSeesADeadlockInsideASubCommunicator) {
  // Pairs {0, 1} and {2, 3}: the first pair's naive exchange deadlocks while the second finishes.
  try {
    run_local_world(
        4,
        [](Comm& comm) {
          const std::shared_ptr<Comm> pair = comm.split(comm.rank() / 2, comm.rank());
          torch::Tensor t = torch::empty({8});
          if (comm.rank() < 2) {
            pair->send(torch::ones({8}), 1 - pair->rank());  // both send first
            pair->recv(t, 1 - pair->rank());
          } else {
            pair->sendrecv(torch::ones({8}), 1 - pair->rank(), t, 1 - pair->rank());
          }
        },
        {std::chrono::milliseconds(200)});
    ADD_FAILURE() << "a naive exchange inside a sub-communicator must deadlock";
  } catch (const DeadlockError& e) {
    const std::string what = e.what();
    for (const char* edge : {"rank 0 send→1", "rank 1 send→0", "already returned"})
      EXPECT_NE(what.find(edge), std::string::npos) << "missing '" << edge << "' in: " << what;
  }
}

CP_TEST(LocalBackend, WaitingForARankThatReturnedIsADeadlock) {
  try {
    run_local_world(
        2,
        [](Comm& comm) {
          if (comm.rank() == 1) return;
          torch::Tensor t = torch::empty({1});
          comm.recv(t, 1);
        },
        {std::chrono::milliseconds(200)});
    ADD_FAILURE() << "expected a DeadlockError";
  } catch (const DeadlockError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 recv←1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("already returned"), std::string::npos) << e.what();
  }
}

CP_TEST(LocalBackend, AFailingRankReleasesTheOthersAndItsErrorIsRethrown) {
  try {
    run_local_world(4, [](Comm& comm) {
      if (comm.rank() == 2) throw std::runtime_error("rank two gave up");
      torch::Tensor t = torch::empty({1});
      comm.recv(t, 2);  // would wait forever without the release
    });
    ADD_FAILURE() << "expected the failure of rank 2";
  } catch (const WorldAborted& e) {
    ADD_FAILURE() << "the original error must win over WorldAborted: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank two gave up");
  }
}

/// Doubles its input; its backward records which thread ran it, per rank.
struct RecordBackwardThread : torch::autograd::Function<RecordBackwardThread> {
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<int, std::thread::id>& threads() {  // rank -> thread that ran its backward
    static std::map<int, std::thread::id> t;
    return t;
  }
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    std::lock_guard<std::mutex> lock(mutex());
    threads()[this_rank()] = std::this_thread::get_id();
    return {g[0] * 2};
  }
};

/// Each rank's backward must run on the rank's own thread: lesson 09's backward communicates,
/// and ranks whose backward passes queue on one shared worker thread (what PyTorch does with
/// CUDA tensors by default) wait for each other forever.
void expect_backward_on_the_rank_thread(torch::Device device) {
  run_local_world(3, [device](Comm& comm) {
    const torch::Tensor x = torch::ones({4}, torch::TensorOptions().device(device).requires_grad(true));
    RecordBackwardThread::apply(x).sum().backward();
    std::lock_guard<std::mutex> lock(RecordBackwardThread::mutex());
    EXPECT_EQ(RecordBackwardThread::threads().at(comm.rank()), std::this_thread::get_id())
        << "rank " << comm.rank() << " on " << device << ": its backward ran on another thread";
  });
}

CP_TEST(LocalBackend, EachRankRunsItsBackwardOnItsOwnThread) { expect_backward_on_the_rank_thread(torch::kCPU); }

CP_TEST(LocalBackendCuda, EachRankRunsItsBackwardOnItsOwnThread) {
  CP_REQUIRE_GPU();
  expect_backward_on_the_rank_thread(torch::kCUDA);
}

/// Every other rank sends to rank 0 at once, so several sender threads copy into rank 0's
/// buffers concurrently (on a GPU: through rank 0's copy stream, created by the first of them).
void expect_many_senders_into_one_rank(torch::Device device) {
  run_local_world(8, [device](Comm& comm) {
    const auto on = torch::TensorOptions().device(device);
    for (int round = 0; round < 3; ++round) {
      if (comm.rank() != 0) {
        comm.start({P2POp::send(rank_tensor(comm.rank(), 1000).to(device), 0)}).wait();
        continue;
      }
      std::vector<torch::Tensor> incoming;
      std::vector<P2POp> ops;
      for (int peer = 1; peer < comm.size(); ++peer) {
        incoming.push_back(torch::empty({1000}, on));
        ops.push_back(P2POp::recv(incoming.back(), peer));
      }
      comm.start(ops).wait();
      for (int peer = 1; peer < comm.size(); ++peer)
        expect_equal(incoming[peer - 1].cpu(), rank_tensor(peer, 1000), "round " + std::to_string(round) +
                                                                            ", from rank " + std::to_string(peer));
    }
  });
}

CP_TEST(LocalBackend, ManySendersIntoOneRank) { expect_many_senders_into_one_rank(torch::kCPU); }

CP_TEST(LocalBackendCuda, ManySendersIntoOneRank) {
  CP_REQUIRE_GPU();
  expect_many_senders_into_one_rank(torch::kCUDA);
}

CP_TEST(LocalBackend, ErrorsCarryTheRank) {
  try {
    run_local_world(3, [](Comm& comm) { CP_CHECK(comm.rank() != 1, "bad value"); });
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[rank 1] ", 0), 0u) << e.what();
  }
}

CP_TEST(Runtime, AnAbandonedReceiveIsWithdrawnAndItsMemoryNeverWritten) {
  // A batch destroyed without wait() (its owner threw between start() and wait()) must not let
  // the backend write a later message into its freed buffer, nor swallow that message. Rank 0
  // abandons a receive from rank 1; only then (a token on the other pair says so) does rank 1
  // send, and rank 0's next receive must get that message.
  for_each_world([](Comm& comm) {
    if (comm.size() < 2 || comm.rank() > 1) return;
    const int64_t n = 16384;  // 64 KiB: freed to the heap, likely reused by the canary below
    if (comm.rank() == 0) {
      {
        torch::Tensor abandoned = torch::empty({n});
        const Request request = comm.start({P2POp::recv(abandoned, 1)});
      }
      const torch::Tensor canary = torch::full({n}, -1.0f);
      comm.send(torch::ones({1}), 1);
      torch::Tensor incoming = torch::empty({n});
      comm.recv(incoming, 1);
      expect_equal(incoming, rank_tensor(1, n), "the message after an abandoned receive");
      EXPECT_TRUE(canary.eq(-1.0f).all().item<bool>()) << "memory of the abandoned receive was written";
    } else {
      torch::Tensor token = torch::empty({1});
      comm.recv(token, 0);
      comm.send(rank_tensor(1, n), 0);
    }
  });
}

CP_TEST(Runtime, ACollectiveShapeMismatchIsTheSameErrorOnEveryRank) {
  for_each_world([](Comm& comm) {
    if (comm.size() == 1) return;  // nobody to disagree with
    auto expect_on_every_rank = [&](const std::function<void()>& call, const std::string& needle) {
      try {
        call();
        ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
      } catch (const ErrorOnEveryRank& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    const bool odd_one = comm.rank() == 1;
    torch::Tensor t = torch::ones({odd_one ? 5 : 4});
    expect_on_every_rank([&] { comm.all_reduce(t, ReduceOp::Sum); },
                         "all_reduce: every rank must pass the same shape and dtype");
    // The same number of elements in another shape: rows would be reinterpreted without the check.
    const torch::Tensor rows = torch::ones(odd_one ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{2, 3});
    expect_on_every_rank([&] { comm.all_gather(rows); }, "all_gather: every rank must pass the same shape and dtype");
    torch::Tensor typed = torch::ones({4}, odd_one ? torch::kDouble : torch::kFloat);
    expect_on_every_rank([&] { comm.broadcast(typed, 0); }, "broadcast: every rank must pass the same shape and dtype");
    const torch::Tensor parts = torch::ones({2 * comm.size() + (odd_one ? 2 : 0)});
    expect_on_every_rank([&] { comm.reduce_scatter(parts); }, "reduce_scatter: every rank must pass the same shape");
  });
}

CP_TEST(Runtime, RunMainTurnsAnEscapingErrorIntoExitStatus) {
  EXPECT_EQ(run_main([] { return 7; }), 7);
  // Seen by every rank: no abort, also under mpirun.
  EXPECT_EQ(run_main([]() -> int { throw ErrorOnEveryRank("every rank sees this"); }), 2);
  if (testing::under_mpirun()) return;  // the other errors abort the world there (fault_test checks it)
  EXPECT_EQ(run_main([]() -> int { throw std::runtime_error("one rank failed"); }), 2);
  bool explained = false;
  EXPECT_EQ(run_main([]() -> int { throw NotImplemented("task 1"); }, [&](const NotImplemented&) { explained = true; }), 1);
  EXPECT_TRUE(explained);
}

// ── the oracle's comparison must be able to fail ──────────────────────────────────────────────

CP_TEST(Oracle, AllCloseReportsWrongElementsWithTheirIndex) {
  const torch::Tensor expected = torch::arange(24, torch::kDouble).view({2, 3, 4}) / 7;
  torch::Tensor actual = expected.to(torch::kFloat);
  CP_EXPECT_CLOSE(actual, expected, "same");
  actual[1][2][3] = 5.0f;
  const auto result = testing::all_close(actual, expected, "out", {"b", "s", "d"});
  ASSERT_FALSE(result);
  EXPECT_NE(std::string(result.message()).find("1 of 24 elements wrong"), std::string::npos) << result.message();
  EXPECT_NE(std::string(result.message()).find("[b=1,s=2,d=3]"), std::string::npos) << result.message();
}

CP_TEST(Oracle, NanNeverMatchesAndInfinitiesMustAgree) {
  const torch::Tensor expected = torch::tensor({1.0f, -INFINITY}).to(torch::kDouble);
  CP_EXPECT_CLOSE(torch::tensor({1.0f, -INFINITY}), expected, "ok");
  EXPECT_FALSE(testing::all_close(torch::tensor({NAN, -INFINITY}), expected, "nan"));
  EXPECT_FALSE(testing::all_close(torch::tensor({1.0f, 0.0f}), expected, "inf"));
  EXPECT_FALSE(testing::all_close(torch::tensor({1.0f}), expected, "shape"));
}

CP_TEST(Oracle, TolerancesGrowWithCoarserDtypes) {
  EXPECT_LT(testing::tolerance_for(torch::kFloat).rel, testing::tolerance_for(torch::kHalf).rel);
  EXPECT_LT(testing::tolerance_for(torch::kHalf).rel, testing::tolerance_for(torch::kBFloat16).rel);
  // One bf16 rounding (2^-8 relative) must pass, four ulps must not.
  const torch::Tensor expected = torch::full({1}, 1.0, torch::kDouble);
  CP_EXPECT_CLOSE(torch::full({1}, 1.0 + 1.0 / 256), expected, "1 ulp", {}, testing::tolerance_for(torch::kBFloat16));
  EXPECT_FALSE(testing::all_close(torch::full({1}, 1.0 + 5.0 / 256), expected, "5 ulp", {}, testing::tolerance_for(torch::kBFloat16)));
}

CP_TEST(MemoryMeter, MeasuresThePeakOfThisThreadsAllocationsOnly) {
  const torch::Tensor before = torch::zeros({1000});  // existed before: its free must not count
  MemoryMeter outer;
  int64_t inner_peak = 0;
  {
    MemoryMeter inner;
    torch::Tensor a = torch::zeros({1000}, torch::kFloat);  // 4000 bytes
    { const torch::Tensor b = torch::zeros({2000}, torch::kDouble); }  // 16000 bytes, freed
    std::thread other([] { const torch::Tensor elsewhere = torch::zeros({100000}); });  // another thread
    other.join();
    inner_peak = inner.peak_bytes();
    EXPECT_EQ(inner.current_bytes(), 4000);
  }
  EXPECT_EQ(inner_peak, 20000);
  EXPECT_EQ(outer.peak_bytes(), 20000) << "an inner meter passes its reports on";
  EXPECT_EQ(outer.current_bytes(), 0);
}

CP_TEST(MemoryMeter, FreeingATensorFromBeforeTheMeterDoesNotCount) {
  // LibTorch reports the free of a block whenever it knew the block's size: on the CPU when the
  // block was allocated under some memory listener (here an earlier meter), on CUDA always.
  torch::Tensor before;
  {
    MemoryMeter earlier;
    before = torch::zeros({1000});  // 4000 bytes, allocated before the meter below
  }
  MemoryMeter meter;
  before = torch::Tensor();                                // freed inside: not the meter's
  const torch::Tensor after = torch::zeros({1000});        // 4000 bytes, the meter's
  EXPECT_EQ(meter.current_bytes(), 4000);
  EXPECT_EQ(meter.peak_bytes(), 4000);
}

}  // namespace
}  // namespace cp
