// The `mpi` backend: one process per rank under mpirun.
//
// Host tensors are passed to MPI directly. Device tensors are staged through host memory,
// because Debian's Open MPI is not CUDA-aware. Blocking send is synchronous mode (MPI_Issend:
// it completes only when the receive has started), so a naive ring deadlocks here exactly as on
// the local backend, whatever the message size; MPI_Send would "work" for small messages
// through the eager protocol and hang for large ones (lesson 06).
//
// Watchdog: every blocking point-to-point call (send, recv, Request::wait) polls its
// non-blocking MPI requests (MPI_Test, MPI_Iprobe) instead of blocking inside MPI, and aborts
// the world with a message naming this rank, the call and its peers when it has not completed
// after CP_MPI_TIMEOUT_S seconds (see mpi_world() in common/world.h). Collectives stay blocking.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/device.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/tensor_checks.h"
#include "common/world.h"

namespace cp {
namespace {

constexpr int kTag = 0;  // one stream of messages per pair; MPI keeps them in order

MPI_Datatype reduction_type(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return MPI_FLOAT;
    case torch::kDouble: return MPI_DOUBLE;
    case torch::kInt: return MPI_INT32_T;
    case torch::kLong: return MPI_INT64_T;
    case torch::kByte: return MPI_UINT8_T;
    default:
      CP_FAIL("mpi backend: reductions support float16, bfloat16, float32, float64, int32, int64 and uint8, got ",
              t.dtype());
  }
}

int byte_count(const torch::Tensor& t) {
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  CP_CHECK(bytes <= INT32_MAX, "mpi backend: messages are limited to 2 GiB, got ", bytes, " bytes");
  return static_cast<int>(bytes);
}

/// A host tensor MPI can read or write for `t`: t itself on the CPU, else a pinned copy.
torch::Tensor host_view(const torch::Tensor& t, bool copy_contents) {
  if (!t.is_cuda()) return t;
  auto options = t.options().device(torch::kCPU).pinned_memory(true);
  torch::Tensor host = torch::empty(t.sizes(), options);
  if (copy_contents) host.copy_(t);  // synchronises with the current stream
  return host;
}

/// The host tensor MPI reduces for `t`. MPI has no standard float16 or bfloat16 type, so these
/// are reduced as a float32 copy that the caller converts back: a sum then rounds to t's dtype
/// once, not once per rank (a max is exact either way). Other dtypes: host_view(t, true).
torch::Tensor reducible(const torch::Tensor& t) {
  if (t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kBFloat16)
    return t.to(torch::TensorOptions().device(torch::kCPU).dtype(torch::kFloat));
  return host_view(t, true);
}

using Clock = std::chrono::steady_clock;

/// The watchdog of one blocking call: poll() is called between non-blocking MPI tests and
/// aborts the world once `timeout_s` has passed since the call began (never when <= 0).
class Deadline {
 public:
  Deadline(double timeout_s, int rank) : timeout_s_(timeout_s), rank_(rank) {}

  /// `what()` names the call and its peers ("send→2"); built only when the time is up.
  template <typename What>
  void poll(const What& what) const {
    if (timeout_s_ > 0 && std::chrono::duration<double>(Clock::now() - start_).count() >= timeout_s_)
      abort_world(what());
    // Yield, never sleep: a large message moves only while both sides call into MPI (Open
    // MPI's own blocking calls spin the same way).
    std::this_thread::yield();
  }

 private:
  [[noreturn]] void abort_world(const std::string& what) const {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "rank %d: %s has not completed after %g s: every rank may be waiting on another (a deadlock, "
                 "lesson 06), or a peer failed. Aborting the world. (CP_MPI_TIMEOUT_S sets the timeout.)\n",
                 rank_, what.c_str(), timeout_s_);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
    std::abort();  // MPI_Abort does not return
  }

  double timeout_s_;
  int rank_;
  Clock::time_point start_ = Clock::now();
};

/// Reads CP_MPI_TIMEOUT_S (seconds; 0 disables the watchdog), 20 when unset.
double watchdog_timeout_s() {
  const char* text = std::getenv("CP_MPI_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return 20.0;
  char* end = nullptr;
  const double value = std::strtod(text, &end);
  CP_CHECK(end != text && *end == '\0' && value == value, "CP_MPI_TIMEOUT_S: expected a number of seconds, got '",
           text, "'");
  return value;
}

/// Keeps `t`'s memory allocated until the process ends: the buffer of an operation that MPI
/// may still read or write (see ~MpiBatch). Never freed, on purpose: a leak bounded by what was
/// abandoned, instead of MPI writing into memory that the allocator handed to someone else.
void keep_until_exit(torch::Tensor t) {
  static std::mutex* mutex = new std::mutex;
  static std::vector<torch::Tensor>* kept = new std::vector<torch::Tensor>;
  std::lock_guard<std::mutex> lock(*mutex);
  kept->push_back(std::move(t));
}

std::string edge(bool is_recv, int peer) { return (is_recv ? "recv←" : "send→") + std::to_string(peer); }

/// A batch in flight. It owns its buffers: `user` and `staging` are tensor handles, so the
/// caller's memory (and the pinned copy of a device tensor) lives as long as the batch.
class MpiBatch : public detail::PendingBatch {
 public:
  struct Entry {
    torch::Tensor user;     // the caller's tensor
    torch::Tensor staging;  // what MPI reads/writes (== user on the CPU)
    bool is_recv;
    int peer;
    MPI_Request request = MPI_REQUEST_NULL;
    bool done = false;       // completed (or failed): MPI no longer touches the buffer
    int error = MPI_SUCCESS;
    MPI_Status status{};
  };

  MpiBatch(int rank, double timeout_s) : rank_(rank), timeout_s_(timeout_s) {}

  void add(MPI_Request request, Entry entry) {
    entry.request = request;
    entries_.push_back(std::move(entry));
  }

  void wait() override {
    const Deadline deadline(timeout_s_, rank_);
    while (!test_all()) deadline.poll([&] { return describe(); });
    for (const Entry& e : entries_) {
      if (e.error == MPI_SUCCESS) continue;
      int error_class = e.error;
      MPI_Error_class(e.error, &error_class);
      CP_CHECK(error_class != MPI_ERR_TRUNCATE, "send/recv mismatch: rank ", e.peer, " sent more than the ",
               byte_count(e.staging), " bytes of the receive buffer (", e.user.numel(), " ", e.user.dtype(),
               " elements)");
      MPI_CHECK(e.error);
    }
    for (Entry& e : entries_) {
      if (!e.is_recv) continue;
      int received = 0;
      MPI_CHECK(MPI_Get_count(&e.status, MPI_BYTE, &received));
      CP_CHECK(received == byte_count(e.staging), "send/recv mismatch: received ", received,
               " bytes from rank ", e.peer, " into a buffer of ", byte_count(e.staging),
               " bytes (", e.user.numel(), " ", e.user.dtype(), " elements)");
      if (e.staging.data_ptr() != e.user.data_ptr()) e.user.copy_(e.staging);
    }
  }

  /// A batch destroyed before it completed: its owner threw between start() and wait(), or
  /// start() itself failed after posting some operations. Freeing the buffers now would let MPI
  /// write a late message into freed memory (even inside MPI_Finalize). So:
  ///  - pending receives are cancelled (MPI_Cancel). An unmatched receive is then complete at
  ///    once and its buffer untouched; a receive already matched completes when its data is in.
  ///    Either way a later receive from that peer gets the peer's next message, as if this one
  ///    had never been posted.
  ///  - sends cannot be cancelled reliably (MPI 4 deprecates it; Open MPI ignores it): they
  ///    complete when their receive starts.
  ///  - for a short grace period MPI_Test drives both to completion. What is still pending then
  ///    (a send nobody receives, a matched receive whose sender is gone) is released with
  ///    MPI_Request_free, and its buffer is kept allocated until the process exits
  ///    (keep_until_exit), so that MPI can never read or write freed memory.
  ~MpiBatch() override {
    if (all_done()) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      for (Entry& e : entries_)
        if (!e.done && e.is_recv) MPI_Cancel(&e.request);  // no throwing from a destructor
      const auto grace_end = Clock::now() + std::chrono::milliseconds(200);
      while (!test_all() && Clock::now() < grace_end) std::this_thread::yield();
    }
    for (Entry& e : entries_) {
      if (e.done) continue;
      if (!finalized && e.request != MPI_REQUEST_NULL) MPI_Request_free(&e.request);
      keep_until_exit(e.staging);
      keep_until_exit(e.user);
    }
  }

 private:
  bool all_done() const {
    for (const Entry& e : entries_)
      if (!e.done) return false;
    return true;
  }

  /// One MPI_Test of every pending operation; true when all are done.
  bool test_all() {
    bool all = true;
    for (Entry& e : entries_) {
      if (e.done) continue;
      int flag = 0;
      const int status = MPI_Test(&e.request, &flag, &e.status);
      if (status != MPI_SUCCESS) {
        e.done = true;  // completed with an error (Open MPI frees the request)
        e.error = status;
        e.request = MPI_REQUEST_NULL;
      } else if (flag) {
        e.done = true;
      } else {
        all = false;
      }
    }
    return all;
  }

  /// "Request::wait of a batch (send→2, recv←0; pending: send→2)".
  std::string describe() const {
    std::string all, pending;
    for (const Entry& e : entries_) {
      all += (all.empty() ? "" : ", ") + edge(e.is_recv, e.peer);
      if (!e.done) pending += (pending.empty() ? "" : ", ") + edge(e.is_recv, e.peer);
    }
    return "Request::wait of a batch (" + all + "; pending: " + pending + ")";
  }

  int rank_;
  double timeout_s_;
  std::vector<Entry> entries_;
};

class MpiComm : public Comm {
 public:
  /// Takes ownership of `comm` (a duplicate of the world, or a split of it).
  MpiComm(std::shared_ptr<detail::MpiSession> session, MPI_Comm comm) : session_(std::move(session)), comm_(comm) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    timeout_s_ = watchdog_timeout_s();
  }

  ~MpiComm() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::Mpi; }

  void send(const torch::Tensor& tensor, int peer) override {
    check_peer(peer, "send");
    check_buffer(tensor, "send");
    const Deadline deadline(timeout_s_, rank_);
    const torch::Tensor host = host_view(tensor, true);
    // Synchronous mode (rendezvous): complete only once the receive has started.
    MPI_Request request;
    MPI_CHECK(MPI_Issend(host.data_ptr(), byte_count(host), MPI_BYTE, peer, kTag, comm_, &request));
    wait_for(request, host, deadline, [&] { return edge(false, peer); });
  }

  void recv(torch::Tensor& tensor, int peer) override {
    check_peer(peer, "recv");
    check_buffer(tensor, "recv");
    const Deadline deadline(timeout_s_, rank_);
    // Probe first so that a size mismatch is a clear error, not a truncation.
    MPI_Status status;
    int arrived = 0, incoming = 0;
    while (true) {
      MPI_CHECK(MPI_Iprobe(peer, kTag, comm_, &arrived, &status));
      if (arrived) break;
      deadline.poll([&] { return edge(true, peer); });
    }
    MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &incoming));
    CP_CHECK(incoming == byte_count(tensor), "send/recv mismatch: rank ", peer, " sends ", incoming,
             " bytes, but the receive buffer has ", byte_count(tensor), " bytes (", tensor.numel(),
             " ", tensor.dtype(), " elements)");
    torch::Tensor host = host_view(tensor, false);
    MPI_Request request;
    MPI_CHECK(MPI_Irecv(host.data_ptr(), byte_count(host), MPI_BYTE, peer, kTag, comm_, &request));
    wait_for(request, host, deadline, [&] { return edge(true, peer); });
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);
  }

  Request start(const std::vector<P2POp>& ops) override {
    for (const P2POp& op : ops) {  // every check before anything is posted
      check_peer(op.peer, "start");
      check_buffer(op.tensor, "start");
      byte_count(op.tensor);
    }
    // If posting fails half-way, the batch's destructor takes care of what was posted.
    auto batch = std::make_unique<MpiBatch>(rank_, timeout_s_);
    for (const P2POp& op : ops) {
      const bool is_recv = op.kind == P2POp::Kind::Recv;
      torch::Tensor staging = host_view(op.tensor, !is_recv);
      MPI_Request request;
      if (is_recv)
        MPI_CHECK(MPI_Irecv(staging.data_ptr(), byte_count(staging), MPI_BYTE, op.peer, kTag, comm_, &request));
      else
        MPI_CHECK(MPI_Isend(staging.data_ptr(), byte_count(staging), MPI_BYTE, op.peer, kTag, comm_, &request));
      batch->add(request, {op.tensor, staging, is_recv, op.peer});
    }
    return Request(std::move(batch));
  }

  torch::Tensor all_gather(const torch::Tensor& tensor) override {
    check_buffer(tensor, "all_gather");
    check_same_on_every_rank(*this, tensor, "all_gather");
    const torch::Tensor host = host_view(tensor, true);
    std::vector<int64_t> shape = tensor.sizes().vec();
    if (shape.empty()) shape.push_back(1);
    shape[0] *= size_;
    torch::Tensor gathered = torch::empty(shape, host.options().pinned_memory(false));
    MPI_CHECK(MPI_Allgather(host.data_ptr(), byte_count(host), MPI_BYTE, gathered.data_ptr(),
                            byte_count(host), MPI_BYTE, comm_));
    return gathered.to(tensor.device());
  }

  torch::Tensor reduce_scatter(const torch::Tensor& tensor) override {
    check_buffer(tensor, "reduce_scatter");
    check_same_on_every_rank(*this, tensor, "reduce_scatter");
    CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size_ == 0,
             "reduce_scatter: dim 0 must be divisible by the world size ", size_, ", got shape ", tensor.sizes());
    const torch::Tensor host = reducible(tensor);
    std::vector<int64_t> shape = tensor.sizes().vec();
    shape[0] /= size_;
    torch::Tensor part = torch::empty(shape, host.options().pinned_memory(false));
    MPI_CHECK(MPI_Reduce_scatter_block(host.data_ptr(), part.data_ptr(), static_cast<int>(part.numel()),
                                       reduction_type(host), MPI_SUM, comm_));
    return part.to(tensor.device(), tensor.scalar_type());
  }

  void all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    check_buffer(tensor, "all_reduce");
    check_same_on_every_rank(*this, tensor, "all_reduce");
    torch::Tensor host = reducible(tensor);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), reduction_type(host),
                            op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, comm_));
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);  // back to the tensor's device and dtype
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    check_buffer(tensor, "broadcast");
    check_peer(root, "broadcast (root)");
    check_same_on_every_rank(*this, tensor, "broadcast");
    torch::Tensor host = host_view(tensor, rank_ == root);
    MPI_CHECK(MPI_Bcast(host.data_ptr(), byte_count(host), MPI_BYTE, root, comm_));
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);
  }

  void barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }

  torch::Tensor all_to_all(const torch::Tensor& tensor) override {
    check_buffer(tensor, "all_to_all");
    check_same_on_every_rank(*this, tensor, "all_to_all");
    CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size_ == 0,
             "all_to_all: dim 0 must be divisible by the world size ", size_, ", got shape ", tensor.sizes());
    const torch::Tensor host = host_view(tensor, true);
    torch::Tensor exchanged = torch::empty_like(host, host.options().pinned_memory(false));
    const int part_bytes = byte_count(host) / size_;
    MPI_CHECK(MPI_Alltoall(host.data_ptr(), part_bytes, MPI_BYTE, exchanged.data_ptr(), part_bytes, MPI_BYTE, comm_));
    return exchanged.to(tensor.device());
  }

  std::shared_ptr<Comm> split(int color, int key) override {
    CP_CHECK(color >= 0, "split: color must be >= 0, got ", color);
    MPI_Comm part;
    MPI_CHECK(MPI_Comm_split(comm_, color, key, &part));
    return std::make_shared<MpiComm>(session_, part);
  }

  /// Makes this process's GPU current (detail::use_node_gpu; collective).
  void use_node_gpu() { detail::use_node_gpu(comm_); }

 private:
  /// Polls one request of a blocking call until it completes (the watchdog runs meanwhile).
  template <typename What>
  static void wait_for(MPI_Request& request, const torch::Tensor& buffer, const Deadline& deadline, const What& what) {
    while (true) {
      int done = 0;
      const int status = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (status != MPI_SUCCESS) {
        keep_until_exit(buffer);  // whatever state MPI left the request in, never free its buffer
        MPI_CHECK(status);
      }
      if (done) return;
      deadline.poll(what);
    }
  }

  std::shared_ptr<detail::MpiSession> session_;  // declared first: outlives comm_
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = 20;  // CP_MPI_TIMEOUT_S
};

}  // namespace

std::shared_ptr<Comm> mpi_world() {
  run_backward_on_this_thread();  // the rank's backward communicates: keep it (and MPI) on this thread
  std::shared_ptr<detail::MpiSession> session = detail::MpiSession::get();  // MPI_Init, before duplicate_world
  auto comm = std::make_shared<MpiComm>(session, detail::duplicate_world());
  set_this_rank(comm->rank());
  // A GPU per process, as nccl_world picks it, so that a rank's CUDA tensors (torch::kCUDA: the
  // current device) are not all on cuda:0. Processes share GPUs when a node has fewer, which the
  // mpi backend allows: it stages device tensors through host memory.
  if (cuda_unavailable_reason().empty()) comm->use_node_gpu();
  return comm;
}

}  // namespace cp
