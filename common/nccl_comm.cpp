// The `nccl` backend: one GPU per process, bootstrapped over MPI (rank 0 creates the
// ncclUniqueId and MPI_Bcast gives it to the others).
//
// Collectives run on the caller's current stream. A batch started with start() runs on a
// separate communication stream ordered after the caller's current work, so that the caller
// can compute while it is in flight; Request::wait() orders the caller's stream after it.
#include <nccl.h>
#include <torch/types.h>
#include <unistd.h>

#include <cstring>
#include <vector>


#include "common/cuda_check.h"
#include "common/device.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/tensor_checks.h"
#include "common/world.h"

/// Throws cp::Error (with rank, file, line) when an NCCL call fails.
#define NCCL_CHECK(call)                                                                  \
  do {                                                                                    \
    const ncclResult_t cp_nccl_status = (call);                                           \
    if (cp_nccl_status != ncclSuccess)                                                    \
      CP_FAIL("NCCL error in ", #call, ": ", ncclGetErrorString(cp_nccl_status));          \
  } while (0)

namespace cp {
namespace {

ncclDataType_t nccl_type(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return ncclFloat32;
    case torch::kDouble: return ncclFloat64;
    case torch::kHalf: return ncclFloat16;
    case torch::kBFloat16: return ncclBfloat16;
    case torch::kInt: return ncclInt32;
    case torch::kLong: return ncclInt64;
    case torch::kByte: return ncclUint8;
    default: CP_FAIL("nccl backend: unsupported dtype ", t.dtype());
  }
}

/// An event on `stream`, for ordering another stream after it.
std::shared_ptr<CUevent_st> record(cudaStream_t stream) {
  cudaEvent_t event;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(event, stream));
  return {event, [](cudaEvent_t e) { cudaEventDestroy(e); }};
}

class NcclBatch : public detail::PendingBatch {
 public:
  NcclBatch(std::shared_ptr<CUevent_st> done, std::vector<torch::Tensor> keep_alive)
      : done_(std::move(done)), keep_alive_(std::move(keep_alive)) {}
  void wait() override { CUDA_CHECK(cudaStreamWaitEvent(current_cuda_stream(), done_.get(), 0)); }

 private:
  std::shared_ptr<CUevent_st> done_;
  std::vector<torch::Tensor> keep_alive_;  // the buffers must outlive the transfer
};

class NcclComm : public Comm {
 public:
  NcclComm() : session_(detail::MpiSession::get()), mpi_(detail::duplicate_world()) {
    MPI_CHECK(MPI_Comm_rank(mpi_, &rank_));
    MPI_CHECK(MPI_Comm_size(mpi_, &size_));
    set_this_rank(rank_);
    device_ = pick_device();
    CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId id;
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi_));
    NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }

  /// A sub-communicator of `parent` (split): its own MPI and NCCL communicators, the same GPU.
  NcclComm(const NcclComm& parent, int color, int key) : session_(parent.session_), device_(parent.device_) {
    MPI_CHECK(MPI_Comm_split(parent.mpi_, color, key, &mpi_));
    MPI_CHECK(MPI_Comm_rank(mpi_, &rank_));
    MPI_CHECK(MPI_Comm_size(mpi_, &size_));
    NCCL_CHECK(ncclCommSplit(parent.nccl_, color, key, &nccl_, nullptr));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }

  ~NcclComm() override {
    cudaStreamDestroy(comm_stream_);
    ncclCommDestroy(nccl_);
    MPI_Comm_free(&mpi_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::Nccl; }

  void send(const torch::Tensor& tensor, int peer) override {
    start({P2POp::send(tensor, peer)}).wait();
    CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream()));  // blocking: the data has left
  }

  void recv(torch::Tensor& tensor, int peer) override {
    start({P2POp::recv(tensor, peer)}).wait();
    CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream()));
  }

  Request start(const std::vector<P2POp>& ops) override {
    std::vector<torch::Tensor> buffers;
    for (const P2POp& op : ops) {
      check_peer(op.peer, "start");
      check_device_buffer(op.tensor, "start");
      buffers.push_back(op.tensor);
    }
    // The transfer must not read or overwrite buffers before the caller's work on them is done.
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, record(current_cuda_stream()).get(), 0));
    NCCL_CHECK(ncclGroupStart());
    for (const P2POp& op : ops) {
      if (op.kind == P2POp::Kind::Send)
        NCCL_CHECK(ncclSend(op.tensor.data_ptr(), op.tensor.numel(), nccl_type(op.tensor), op.peer, nccl_, comm_stream_));
      else
        NCCL_CHECK(ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), nccl_type(op.tensor), op.peer, nccl_, comm_stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
    return Request(std::make_unique<NcclBatch>(record(comm_stream_), std::move(buffers)));
  }

  torch::Tensor all_gather(const torch::Tensor& tensor) override {
    check_device_buffer(tensor, "all_gather");
    check_same_on_every_rank(*this, tensor, "all_gather");
    std::vector<int64_t> shape = tensor.sizes().vec();
    if (shape.empty()) shape.push_back(1);
    shape[0] *= size_;
    torch::Tensor gathered = torch::empty(shape, tensor.options());
    NCCL_CHECK(ncclAllGather(tensor.data_ptr(), gathered.data_ptr(), tensor.numel(), nccl_type(tensor), nccl_,
                             current_cuda_stream()));
    return gathered;
  }

  torch::Tensor reduce_scatter(const torch::Tensor& tensor) override {
    check_device_buffer(tensor, "reduce_scatter");
    check_same_on_every_rank(*this, tensor, "reduce_scatter");
    CP_CHECK(tensor.dim() >= 1 && tensor.size(0) % size_ == 0,
             "reduce_scatter: dim 0 must be divisible by the world size ", size_, ", got shape ", tensor.sizes());
    std::vector<int64_t> shape = tensor.sizes().vec();
    shape[0] /= size_;
    torch::Tensor part = torch::empty(shape, tensor.options());
    NCCL_CHECK(ncclReduceScatter(tensor.data_ptr(), part.data_ptr(), part.numel(), nccl_type(tensor), ncclSum, nccl_,
                                 current_cuda_stream()));
    return part;
  }

  void all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    check_device_buffer(tensor, "all_reduce");
    check_same_on_every_rank(*this, tensor, "all_reduce");
    NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor),
                             op == ReduceOp::Sum ? ncclSum : ncclMax, nccl_, current_cuda_stream()));
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    check_device_buffer(tensor, "broadcast");
    check_peer(root, "broadcast (root)");
    check_same_on_every_rank(*this, tensor, "broadcast");
    NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), root, nccl_,
                             current_cuda_stream()));
  }

  void barrier() override {
    CUDA_CHECK(cudaStreamSynchronize(current_cuda_stream()));
    MPI_CHECK(MPI_Barrier(mpi_));
  }

  // all_to_all: the generic one, a grouped ncclSend/ncclRecv per peer through start().

  std::shared_ptr<Comm> split(int color, int key) override {
    CP_CHECK(color >= 0, "split: color must be >= 0, got ", color);
    CUDA_CHECK(cudaSetDevice(device_));
    return std::make_shared<NcclComm>(*this, color, key);
  }

 private:
  void check_device_buffer(const torch::Tensor& tensor, const char* what) const {
    check_buffer(tensor, what);
    CP_CHECK(tensor.is_cuda() && tensor.device().index() == device_, what, ": the nccl backend moves tensors on cuda:",
             device_, " (this rank's GPU), got a tensor on ", tensor.device(), "; use the mpi backend for CPU tensors");
  }

  /// One GPU per rank: the node-local rank picks among the GPUs this process sees. NCCL cannot
  /// run two ranks on one GPU ("Duplicate GPU detected"), so every rank compares its (host,
  /// PCI bus id) with the others' and the world refuses to start if two are the same.
  int pick_device() {
    MPI_Comm node;
    MPI_CHECK(MPI_Comm_split_type(mpi_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
    CP_CHECK(gpus > 0, "nccl backend: this process sees no GPU; use --backend local or --backend mpi");
    const int device = local_rank % gpus;

    constexpr int kKey = 128;
    char key[kKey] = {};
    gethostname(key, kKey / 2);
    const size_t host_length = std::strlen(key);
    key[host_length] = '/';
    CUDA_CHECK(cudaDeviceGetPCIBusId(key + host_length + 1, kKey - static_cast<int>(host_length) - 1, device));
    std::vector<char> keys(static_cast<size_t>(kKey) * size_);
    MPI_CHECK(MPI_Allgather(key, kKey, MPI_CHAR, keys.data(), kKey, MPI_CHAR, mpi_));
    for (int r = 0; r < size_; ++r) {
      for (int s = r + 1; s < size_; ++s) {
        CP_CHECK(std::strncmp(&keys[r * kKey], &keys[s * kKey], kKey) != 0, "nccl backend: ranks ", r, " and ", s,
                 " would share the GPU ", &keys[r * kKey], ", but NCCL needs one GPU per rank (it fails with "
                 "\"Duplicate GPU detected\"). Launch at most one rank per GPU, or use --backend local (ranks as "
                 "threads sharing one GPU) or --backend mpi (GPU tensors staged through host memory).");
      }
    }
    return device;
  }

  std::shared_ptr<detail::MpiSession> session_;  // declared first: outlives the communicators
  MPI_Comm mpi_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  ncclComm_t nccl_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
};

}  // namespace

std::shared_ptr<Comm> nccl_world() {
  CP_CHECK(cuda_unavailable_reason().empty(), "nccl backend: ", cuda_unavailable_reason());
  run_backward_on_this_thread();  // the rank's backward communicates: keep it on this thread
  return std::make_shared<NcclComm>();
}

}  // namespace cp
