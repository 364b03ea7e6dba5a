// Lesson 02 — distributed ring softmax. Every algorithm against LibTorch's softmax of the
// whole row, on local worlds of 1, 2, 3, 4, 8 ranks or on the mpirun world.
#include <torch/types.h>

#include "common/error.h"
#include "common/world.h"
#include "ring_softmax.h"
#include "testing/harness.h"
#include "testing/oracle.h"

namespace cp {
namespace {

using testing::all_close;
using testing::for_each_world;
using testing::oracle_softmax;
using testing::random_with_outliers;

const char* name_of(RingSoftmaxAlgo algo) {
  switch (algo) {
    case RingSoftmaxAlgo::Chain: return "Chain";
    case RingSoftmaxAlgo::Ring: return "Ring";
    case RingSoftmaxAlgo::TwoAllReduce: return "TwoAllReduce";
  }
  return "?";
}

/// Column widths of the N shards: even, or uneven with an empty shard (rank 1 when N > 1).
std::vector<int64_t> shard_widths(int n, bool uneven) {
  std::vector<int64_t> widths(n, 37);
  if (uneven)
    for (int r = 0; r < n; ++r) widths[r] = r == 1 ? 0 : 5 + 29 * r;
  return widths;
}

/// This rank's columns of the full rows x: [rows, offset_r : offset_r + width_r].
torch::Tensor my_columns(const torch::Tensor& x, const std::vector<int64_t>& widths, int rank) {
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += widths[r];
  return x.narrow(-1, offset, widths[rank]);
}

/// Runs `algo` on shards of the same full rows on every rank and compares each shard's output
/// with the softmax of the full rows. `prepare` may edit the full rows (same on every rank).
void check_algorithm(RingSoftmaxAlgo algo, torch::Device device,
                     const std::vector<torch::ScalarType>& dtypes = {torch::kFloat, torch::kDouble}) {
  for_each_world([&](Comm& comm) {
    for (bool uneven : {false, true}) {
      const std::vector<int64_t> widths = shard_widths(comm.size(), uneven);
      int64_t total = 0;
      for (int64_t w : widths) total += w;
      torch::Tensor x = random_with_outliers({6, total}, 1000 + total, 4.0, 1e4);
      x[2].fill_(-INFINITY);  // a row that is -inf on every rank: zeros, not NaN
      if (comm.size() > 2) my_columns(x, widths, 2).fill_(-INFINITY);  // rank 2's shard: all -inf
      for (auto dtype : dtypes) {
        // The oracle sees the same rounded inputs as the code under test.
        const torch::Tensor expected = my_columns(oracle_softmax(x.to(dtype)), widths, comm.rank());
        const torch::Tensor mine = my_columns(x, widths, comm.rank()).to(device, dtype);
        const torch::Tensor y = ring_softmax(comm, mine, algo);
        EXPECT_EQ(y.scalar_type(), dtype);
        CP_EXPECT_CLOSE(y, expected,
                              std::string(name_of(algo)) + (uneven ? " uneven" : " even") + " shards, rank " +
                                  std::to_string(comm.rank()) + " of " + std::to_string(comm.size()),
                              {"row", "col"});
      }
    }
  });
}

// ── Task 1: states on tensors ─────────────────────────────────────────────────────────────────

CP_TEST(Lesson02, Task1_LocalStatesMergeIntoTheStateOfTheWholeRow) {
  const torch::Tensor x = random_with_outliers({5, 300}, 3, 4.0, 1e4);
  const std::vector<int64_t> cuts = {0, 0, 17, 150, 151, 300};  // pieces of 0, 17, 133, 1, 149 columns
  RowStates merged = local_row_states(x.narrow(-1, 0, 0));
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    merged = merge_row_states(merged, local_row_states(x.narrow(-1, cuts[i], cuts[i + 1] - cuts[i])));
  // l·exp(m) must be Σ exp(x): compare the log-sum-exp of the merged state with the oracle's.
  const torch::Tensor lse = merged.m + torch::log(merged.l);
  CP_EXPECT_CLOSE(lse, torch::logsumexp(x.to(torch::kDouble), -1), "log(l) + m of the merged states");
}

CP_TEST(Lesson02, Task1_EmptyStatesMergeWithoutNan) {
  const RowStates empty = local_row_states(torch::full({3, 4}, -INFINITY));
  EXPECT_TRUE(torch::equal(empty.l, torch::zeros({3})));
  EXPECT_TRUE((empty.m == -INFINITY).all().item<bool>());
  const RowStates both = merge_row_states(empty, empty);
  EXPECT_FALSE(both.l.isnan().any().item<bool>());
  EXPECT_TRUE(torch::equal(both.l, torch::zeros({3})));
  const RowStates some = local_row_states(torch::tensor({{1.0f, 2.0f}, {-INFINITY, 0.0f}, {3.0f, 3.0f}}));
  const RowStates merged = merge_row_states(empty, some);
  CP_EXPECT_CLOSE(merged.m + torch::log(merged.l), some.m + torch::log(some.l), "empty + some");
}

// ── Tasks 2–4: the three algorithms ───────────────────────────────────────────────────────────

CP_TEST(Lesson02, Task2_ChainMatchesTorch) { check_algorithm(RingSoftmaxAlgo::Chain, torch::kCPU); }

CP_TEST(Lesson02, Task3_RingMatchesTorch) { check_algorithm(RingSoftmaxAlgo::Ring, torch::kCPU); }

CP_TEST(Lesson02, Task4_TwoAllReduceMatchesTorch) { check_algorithm(RingSoftmaxAlgo::TwoAllReduce, torch::kCPU); }

CP_TEST(Lesson02, Task4_MismatchedRowsBetweenRanksIsAClearError) {
  // The row dimensions must agree; here rank 1 has one row more. The point-to-point algorithms
  // see it as a send/recv size mismatch on the ranks that receive from rank 1 (local world only:
  // under mpirun the others would be aborted); the collectives check shapes on every rank.
  for (RingSoftmaxAlgo algo : {RingSoftmaxAlgo::Chain, RingSoftmaxAlgo::Ring, RingSoftmaxAlgo::TwoAllReduce}) {
    const std::string expected =
        algo == RingSoftmaxAlgo::TwoAllReduce ? "all_reduce: every rank must pass the same shape" : "mismatch";
    try {
      run_local_world(3, [&](Comm& comm) { ring_softmax(comm, torch::zeros({comm.rank() == 1 ? 5 : 4, 8}), algo); });
      ADD_FAILURE() << name_of(algo) << ": expected a cp::Error";
    } catch (const NotImplemented&) {
      throw;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << name_of(algo) << ": " << e.what();
    }
  }
}

CP_TEST(Lesson02, Task4_BadInputGivesClearErrors) {
  for_each_world([](Comm& comm) {
    ring_softmax(comm, torch::zeros({1, 2}), RingSoftmaxAlgo::TwoAllReduce);  // counts once implemented
    try {
      ring_softmax(comm, torch::zeros({2, 3}, torch::kInt), RingSoftmaxAlgo::Ring);
      ADD_FAILURE() << "expected a cp::Error for an int tensor";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("x_local: the CPU path takes float32 or float64"), std::string::npos)
          << e.what();
    }
  });
}

CP_TEST(Lesson02Cuda, Task4_EveryAlgorithmOnCuda) {
  CP_REQUIRE_GPU();
  for (RingSoftmaxAlgo algo : {RingSoftmaxAlgo::Chain, RingSoftmaxAlgo::Ring, RingSoftmaxAlgo::TwoAllReduce})
    check_algorithm(algo, torch::kCUDA, {torch::kFloat, torch::kHalf, torch::kBFloat16});
}

}  // namespace
}  // namespace cp
