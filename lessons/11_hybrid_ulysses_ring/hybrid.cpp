// GENERATED from solutions/11_hybrid_ulysses_ring/hybrid.cpp by tools/skeleton.
// Learners: write between BEGIN YOUR CODE and END YOUR CODE. Maintainers: edit the solution, then run make skeletons.
// Lesson 11 — hybrid context parallelism: Ulysses inside groups of consecutive ranks (lesson 10),
// the zig-zag ring across the groups (lesson 07).
#include "hybrid.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/tensor_checks.h"
#include "common/trace.h"

namespace cp {

HybridComms make_hybrid_comms(Comm& comm, HybridMesh mesh) {
  CP_CHECK(mesh.ulysses >= 1 && mesh.ring >= 1, "mesh: ulysses and ring must be at least 1, got ", mesh.ulysses,
           " x ", mesh.ring);
  CP_CHECK(mesh.ulysses * mesh.ring == comm.size(), "mesh: ulysses x ring = ", mesh.ulysses, " x ", mesh.ring, " = ",
           mesh.ulysses * mesh.ring, " ranks, but the communicator has ", comm.size());
  HybridComms comms;
  comms.mesh = mesh;
  // BEGIN YOUR CODE task 1: the mesh's communicators
  // TODO(lesson 11, task 1): split comm into this rank's Ulysses group (consecutive ranks) and its ring.
  // README, "Task 1".
  throw NotImplemented("lesson 11, task 1: make_hybrid_comms");
  // END YOUR CODE
  return comms;
}

HybridMesh default_hybrid_mesh(int world, int64_t heads_q, int64_t heads_kv) {
  CP_CHECK(world >= 1, "default_hybrid_mesh: world must be at least 1, got ", world);
  int best = 1;
  for (int u = 1; u * u <= world; ++u) {
    const bool heads_fit = heads_q % u == 0 && heads_kv >= 1 && (heads_kv % u == 0 || u % heads_kv == 0);
    if (world % u == 0 && heads_fit) best = u;
  }
  return {best, world / best};
}

UlyssesVolume hybrid_volume(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq, int64_t head_dim,
                            HybridMesh mesh, int64_t element_size) {
  const int64_t group_seq = seq / mesh.ring;  // the tokens of one Ulysses group
  UlyssesVolume v = ulysses_volume(batch, heads_q, heads_kv, group_seq, head_dim, mesh.ulysses, element_size);
  // The ring's K (and V) chunk: this rank's share of the K/V heads, for the group's tokens.
  const int64_t kv_chunk = batch * (ulysses_kv_heads(heads_q, heads_kv, mesh.ulysses) / mesh.ulysses) * group_seq *
                           head_dim;
  const int64_t kv_hops = (mesh.ring - 1) * 2 * kv_chunk * element_size;
  v.forward_bytes += kv_hops;
  const int64_t accumulator_hops = mesh.ring > 1 ? mesh.ring : 0;  // lesson 05: none on one rank
  v.backward_bytes += kv_hops + accumulator_hops * 2 * kv_chunk * static_cast<int64_t>(sizeof(float));
  return v;
}

namespace {

/// The checks of a hybrid call; returns the K/V heads the Ulysses exchange moves.
int64_t check_hybrid_inputs(const HybridComms& comms, const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v) {
  CP_CHECK(comms.ulysses && comms.ring, "comms: make them with make_hybrid_comms");
  check_attention_inputs(q, k, v);
  // Equal within every group and along every ring: equal on every rank of the mesh.
  const int world = comms.mesh.ulysses * comms.mesh.ring;
  const std::string hint = detail::concat("Is S divisible by 2P = ", 2 * world, "?");
  for (Comm* c : {comms.ulysses.get(), comms.ring.get()}) {
    check_same_on_every_rank(*c, q, "q", hint);
    check_same_on_every_rank(*c, k, "k", hint);
  }
  CP_CHECK(k.size(2) == q.size(2), "k: every rank holds S/P tokens of q, k and v; q has ", q.size(2), ", k has ",
           k.size(2));
  CP_CHECK(q.size(2) % 2 == 0, "q: a zig-zag shard holds two chunks of S/(2P) tokens, so S/P must be even, got ",
           q.size(2), " (S must be divisible by 2P = ", 2 * world, ")");
  return ulysses_kv_heads(q.size(1), k.size(1), comms.mesh.ulysses);
}

/// The order that turns the Ulysses group's gathered tokens (source u's two chunks, u = 0, 1, …)
/// into the ring's zig-zag shard: the first chunks of u = 0 … P_u − 1, then the second chunks of
/// u = P_u − 1 … 0. int64 [P_u · S/P] of indices into the gathered sequence.
torch::Tensor zigzag_order(int ulysses, int64_t shard, torch::Device device) {
  // BEGIN YOUR CODE task 2: the reorder
  // TODO(lesson 11, task 2): the indices that put the group's gathered tokens (source u's shard of `shard`
  // tokens, u = 0 ... ulysses - 1, each two chunks) into the ring's zig-zag order. README, "Task 2".
  (void)ulysses, (void)shard, (void)device;
  throw NotImplemented("lesson 11, task 2: zigzag_order");
  // END YOUR CODE
}

/// This rank's rank in the world, r = g·P_u + u: the name of its spans in a trace.
int world_rank(const HybridComms& comms) { return comms.ring->rank() * comms.mesh.ulysses + comms.ulysses->rank(); }

/// The ring's options for the hybrid's. The ring names its trace spans by its own ranks
/// (0 … P_r − 1), which are the world ranks only when P_u = 1; otherwise it records none, so
/// that no span lands on another rank's row of the trace.
RingOptions ring_options_of(const HybridOptions& options, const HybridComms& comms) {
  RingOptions ring = ring_options(options.causal, comms.mesh.ulysses == 1 ? options.trace : nullptr);
  ring.scale = options.scale;
  return ring;
}

}  // namespace

HybridResult hybrid_attention_forward(const HybridComms& comms, const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const HybridOptions& options) {
  const int64_t kv_heads = check_hybrid_inputs(comms, q, k, v);
  Comm& group = *comms.ulysses;
  const torch::Tensor order = zigzag_order(comms.mesh.ulysses, q.size(2), q.device());
  const RingOptions ring_opts = ring_options_of(options, comms);
  const int rank = world_rank(comms);
  HybridResult result;
  // BEGIN YOUR CODE task 2: the forward
  // TODO(lesson 11, task 2): Ulysses in (lesson 10), tokens into the ring's zig-zag order, lesson 07's
  // zig-zag ring over comms.ring with ring_opts, back out; keep what the ring ran on in result.saved; count
  // the bytes of both; trace spans under `rank`. README, "Task 2".
  (void)kv_heads, (void)group, (void)order, (void)ring_opts, (void)rank, (void)options;
  throw NotImplemented("lesson 11, task 2: hybrid_attention_forward");
  // END YOUR CODE
  return result;
}

HybridGrads hybrid_attention_backward(const HybridComms& comms, const torch::Tensor& dout, const UlyssesSaved& saved,
                                      const HybridOptions& options) {
  CP_CHECK(comms.ulysses && comms.ring, "comms: make them with make_hybrid_comms");
  Comm& group = *comms.ulysses;
  check_ulysses_saved(group, dout, saved);
  check_same_on_every_rank(*comms.ring, dout, "dout");
  const torch::Tensor order = zigzag_order(comms.mesh.ulysses, dout.size(2), dout.device());
  const RingOptions ring_opts = ring_options_of(options, comms);
  const int rank = world_rank(comms);
  HybridGrads grads;
  // BEGIN YOUR CODE task 3: the backward
  // TODO(lesson 11, task 3): dout the way of the forward's q, lesson 07's zig-zag ring backward on what the
  // forward saved, dq, dk, dv back; dk, dv of replicated K/V heads summed. README, "Task 3".
  (void)group, (void)order, (void)ring_opts, (void)rank, (void)options, (void)dout, (void)saved;
  throw NotImplemented("lesson 11, task 3: hybrid_attention_backward");
  // END YOUR CODE
  return grads;
}

namespace {

/// The mesh's communicators of every Comm a hybrid strategy runs on, made on first use. Splitting
/// is collective and not cheap (on NCCL an ncclCommSplit per communicator): once per Comm, not in
/// every forward and backward of every layer step. An entry is found by the Comm's lifetime(), not
/// its address: a Comm made later at the same address (the rank of a next world) must split anew.
/// Entries of Comms that are gone are dropped at the next lookup; the sub-communicators of the
/// live ones stay until the strategy (every copy of it) is gone.
class MeshCache {
 public:
  explicit MeshCache(HybridMesh mesh) : mesh_(mesh) {}

  HybridComms of(Comm& comm) {
    const std::shared_ptr<const void> key = comm.lifetime().lock();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.comm.expired(); }),
                     entries_.end());
      for (const Entry& e : entries_)
        if (e.comm.lock() == key) return e.comms;
    }
    // Unlocked: make_hybrid_comms waits for the other ranks, which may be threads using this cache.
    HybridComms made = make_hybrid_comms(comm, mesh_);
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back({key, made});
    return made;
  }

 private:
  struct Entry {
    std::weak_ptr<const void> comm;  // the parent's lifetime()
    HybridComms comms;
  };
  const HybridMesh mesh_;
  std::mutex mutex_;  // the ranks of a local world are threads that may share one strategy
  std::vector<Entry> entries_;
};

}  // namespace

Strategy hybrid_strategy(HybridMesh mesh) {
  const std::string name = "hybrid " + std::to_string(mesh.ulysses) + "x" + std::to_string(mesh.ring);
  auto meshes = std::make_shared<MeshCache>(mesh);  // shared by the copies of the strategy
  return {name, TokenLayout::ZigZag,
          [meshes](Comm& comm, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, Trace* trace) {
            HybridOptions options;
            options.causal = true;
            options.trace = trace;
            const HybridResult r = hybrid_attention_forward(meshes->of(comm), q, k, v, options);
            return StrategyForward{r.out, r.lse, {r.stats.pairs, r.stats.bytes_ulysses + r.stats.bytes_ring},
                                   to_saved_tensors(r.saved)};
          },
          [meshes](Comm& comm, const torch::Tensor& dout, const std::vector<torch::Tensor>& saved, Trace* trace) {
            HybridOptions options;
            options.causal = true;
            options.trace = trace;
            const HybridGrads g = hybrid_attention_backward(meshes->of(comm), dout, from_saved_tensors(saved), options);
            return StrategyBackward{g.dq, g.dk, g.dv, {g.stats.pairs, g.stats.bytes_ulysses + g.stats.bytes_ring}};
          }};
}

}  // namespace cp
