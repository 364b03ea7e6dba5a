// The `mpi` backend: one process per rank under mpirun.
//
// Host tensors are passed to MPI directly. Device tensors are staged through host memory,
// because Debian's Open MPI is not CUDA-aware. Blocking send is MPI_Ssend (synchronous mode:
// it completes only when the receive has started), so a naive ring deadlocks here exactly as on
// the local backend, whatever the message size; MPI_Send would "work" for small messages
// through the eager protocol and hang for large ones (lesson 06).
#include "common/device.h"
#include "common/error.h"
#include "common/mpi_session.h"
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
      CP_FAIL("mpi backend: reductions support float32, float64, int32, int64 and uint8, got ",
              t.dtype(), " (MPI has no half-precision type); reduce in float32 instead");
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

class MpiBatch : public detail::PendingBatch {
 public:
  struct Entry {
    torch::Tensor user;     // the caller's tensor
    torch::Tensor staging;  // what MPI reads/writes (== user on the CPU)
    bool is_recv;
    int peer;
  };

  void add(MPI_Request request, Entry entry) {
    requests_.push_back(request);
    entries_.push_back(std::move(entry));
  }

  void wait() override {
    std::vector<MPI_Status> statuses(requests_.size());
    const int status = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), statuses.data());
    for (size_t i = 0; i < entries_.size() && status == MPI_ERR_IN_STATUS; ++i) {
      const Entry& e = entries_[i];
      CP_CHECK(statuses[i].MPI_ERROR != MPI_ERR_TRUNCATE, "send/recv mismatch: rank ", e.peer,
               " sent more than the ", byte_count(e.staging), " bytes of the receive buffer (",
               e.user.numel(), " ", e.user.dtype(), " elements)");
    }
    MPI_CHECK(status);
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if (!e.is_recv) continue;
      int received = 0;
      MPI_CHECK(MPI_Get_count(&statuses[i], MPI_BYTE, &received));
      CP_CHECK(received == byte_count(e.staging), "send/recv mismatch: received ", received,
               " bytes from rank ", e.peer, " into a buffer of ", byte_count(e.staging),
               " bytes (", e.user.numel(), " ", e.user.dtype(), " elements)");
      if (e.staging.data_ptr() != e.user.data_ptr()) e.user.copy_(e.staging);
    }
  }

 private:
  std::vector<MPI_Request> requests_;
  std::vector<Entry> entries_;
};

class MpiComm : public Comm {
 public:
  MpiComm() : session_(detail::MpiSession::get()), comm_(detail::duplicate_world()) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
    set_this_rank(rank_);
  }

  ~MpiComm() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::Mpi; }

  void send(const torch::Tensor& tensor, int peer) override {
    check_peer(peer, "send");
    check_buffer(tensor, "send");
    const torch::Tensor host = host_view(tensor, true);
    MPI_CHECK(MPI_Ssend(host.data_ptr(), byte_count(host), MPI_BYTE, peer, kTag, comm_));
  }

  void recv(torch::Tensor& tensor, int peer) override {
    check_peer(peer, "recv");
    check_buffer(tensor, "recv");
    // Probe first so that a size mismatch is a clear error, not a truncation.
    MPI_Status status;
    int incoming = 0;
    MPI_CHECK(MPI_Probe(peer, kTag, comm_, &status));
    MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &incoming));
    CP_CHECK(incoming == byte_count(tensor), "send/recv mismatch: rank ", peer, " sends ", incoming,
             " bytes, but the receive buffer has ", byte_count(tensor), " bytes (", tensor.numel(),
             " ", tensor.dtype(), " elements)");
    torch::Tensor host = host_view(tensor, false);
    MPI_CHECK(MPI_Recv(host.data_ptr(), byte_count(host), MPI_BYTE, peer, kTag, comm_, MPI_STATUS_IGNORE));
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);
  }

  Request start(const std::vector<P2POp>& ops) override {
    auto batch = std::make_unique<MpiBatch>();
    for (const P2POp& op : ops) {
      check_peer(op.peer, "start");
      check_buffer(op.tensor, "start");
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
    check_same_numel(tensor, "all_gather");
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
    check_same_numel(tensor, "reduce_scatter");
    CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size_ == 0,
             "reduce_scatter: dim 0 must be divisible by the world size ", size_, ", got shape ", tensor.sizes());
    const torch::Tensor host = host_view(tensor, true);
    std::vector<int64_t> shape = tensor.sizes().vec();
    shape[0] /= size_;
    torch::Tensor part = torch::empty(shape, host.options().pinned_memory(false));
    MPI_CHECK(MPI_Reduce_scatter_block(host.data_ptr(), part.data_ptr(), static_cast<int>(part.numel()),
                                       reduction_type(tensor), MPI_SUM, comm_));
    return part.to(tensor.device());
  }

  void all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    check_buffer(tensor, "all_reduce");
    check_same_numel(tensor, "all_reduce");
    torch::Tensor host = host_view(tensor, true);
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), static_cast<int>(host.numel()), reduction_type(tensor),
                            op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, comm_));
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    check_buffer(tensor, "broadcast");
    check_peer(root, "broadcast (root)");
    check_same_numel(tensor, "broadcast");
    torch::Tensor host = host_view(tensor, rank_ == root);
    MPI_CHECK(MPI_Bcast(host.data_ptr(), byte_count(host), MPI_BYTE, root, comm_));
    if (host.data_ptr() != tensor.data_ptr()) tensor.copy_(host);
  }

  void barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }

 private:
  void check_same_numel(const torch::Tensor& tensor, const char* what) {
    detail::check_same_numel(comm_, tensor.numel(), what);
  }

  std::shared_ptr<detail::MpiSession> session_;  // declared first: outlives comm_
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::shared_ptr<Comm> mpi_world() {
  run_backward_on_this_thread();  // the rank's backward communicates: keep it (and MPI) on this thread
  return std::make_shared<MpiComm>();
}

}  // namespace cp
