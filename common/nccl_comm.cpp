// The `nccl` backend: one GPU per process, bootstrapped over MPI (rank 0 creates the
// ncclUniqueId and MPI_Bcast gives it to the others).
//
// Collectives run on the current LibTorch stream of the communicator's GPU: the stream the
// caller's work on this rank's tensors runs on. Every call makes that GPU current for its
// duration (CudaDeviceScope), since the calling thread may have another device current, and a
// stream, an event or a kernel of one device cannot be used with another. A batch started with
// start() runs on a separate communication stream of that GPU, ordered after the caller's
// current work, so that the caller can compute while it is in flight; Request::wait() orders
// the caller's stream after it.
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

/// A batch in flight. It holds no buffers: start() has recorded them as used by the comm
/// stream (record_stream_use), so their memory is not reused while the transfer may still read or
/// write it, even when this batch is destroyed without wait() (its owner threw). Synchronising
/// in the destructor instead would hang that error path whenever a peer never posts its side.
class NcclBatch : public detail::PendingBatch {
 public:
  NcclBatch(std::shared_ptr<CUevent_st> done, torch::Device device) : done_(std::move(done)), device_(device) {}
  void wait() override {
    const CudaDeviceScope cuda(device_);
    CUDA_CHECK(cudaStreamWaitEvent(cuda.stream(), done_.get(), 0));
  }

 private:
  std::shared_ptr<CUevent_st> done_;  // recorded on the comm stream after the batch
  torch::Device device_;              // the communicator's GPU
};

class NcclComm : public Comm {
 public:
  NcclComm() : session_(detail::MpiSession::get()), mpi_(detail::duplicate_world()) {
    MPI_CHECK(MPI_Comm_rank(mpi_, &rank_));
    MPI_CHECK(MPI_Comm_size(mpi_, &size_));
    set_this_rank(rank_);
    device_ = detail::use_node_gpu(mpi_);  // now the current device: the stream below is on it
    check_one_rank_per_gpu();
    ncclUniqueId id;
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, mpi_));
    NCCL_CHECK(ncclCommInitRank(&nccl_, size_, id, rank_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }

  /// A sub-communicator of `parent` (split): its own MPI and NCCL communicators, the same GPU.
  NcclComm(const NcclComm& parent, int color, int key) : session_(parent.session_), device_(parent.device_) {
    const CudaDeviceScope cuda(device());  // the comm stream is created on the current device
    MPI_CHECK(MPI_Comm_split(parent.mpi_, color, key, &mpi_));
    MPI_CHECK(MPI_Comm_rank(mpi_, &rank_));
    MPI_CHECK(MPI_Comm_size(mpi_, &size_));
    // ncclCommSplit appeared in NCCL 2.18; the build requires NCCL >= 2.18 (CMake checks NCCL_VERSION).
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
    const CudaDeviceScope cuda(device());
    CUDA_CHECK(cudaStreamSynchronize(cuda.stream()));  // blocking: the data has left
  }

  void recv(torch::Tensor& tensor, int peer) override {
    start({P2POp::recv(tensor, peer)}).wait();
    const CudaDeviceScope cuda(device());
    CUDA_CHECK(cudaStreamSynchronize(cuda.stream()));
  }

  Request start(const std::vector<P2POp>& ops) override {
    for (const P2POp& op : ops) {
      check_peer(op.peer, "start");
      check_device_buffer(op.tensor, "start");
    }
    const CudaDeviceScope cuda(device());
    // The transfer must not read or overwrite buffers before the caller's work on them is done.
    CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, record(cuda.stream()).get(), 0));
    // ... and their memory must not go to another tensor before the transfer is done, whenever
    // the caller frees them (see NcclBatch).
    for (const P2POp& op : ops) record_stream_use(op.tensor, comm_stream_, device());
    NCCL_CHECK(ncclGroupStart());
    for (const P2POp& op : ops) {
      if (op.kind == P2POp::Kind::Send)
        NCCL_CHECK(ncclSend(op.tensor.data_ptr(), op.tensor.numel(), nccl_type(op.tensor), op.peer, nccl_, comm_stream_));
      else
        NCCL_CHECK(ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), nccl_type(op.tensor), op.peer, nccl_, comm_stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
    return Request(std::make_unique<NcclBatch>(record(comm_stream_), device()));
  }

  torch::Tensor all_gather(const torch::Tensor& tensor) override {
    check_device_buffer(tensor, "all_gather");
    check_same_on_every_rank(*this, tensor, "all_gather");
    std::vector<int64_t> shape = tensor.sizes().vec();
    if (shape.empty()) shape.push_back(1);
    shape[0] *= size_;
    torch::Tensor gathered = torch::empty(shape, tensor.options());
    const CudaDeviceScope cuda(device());
    NCCL_CHECK(ncclAllGather(tensor.data_ptr(), gathered.data_ptr(), tensor.numel(), nccl_type(tensor), nccl_,
                             cuda.stream()));
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
    const CudaDeviceScope cuda(device());
    NCCL_CHECK(ncclReduceScatter(tensor.data_ptr(), part.data_ptr(), part.numel(), nccl_type(tensor), ncclSum, nccl_,
                                 cuda.stream()));
    return part;
  }

  void all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    check_device_buffer(tensor, "all_reduce");
    check_same_on_every_rank(*this, tensor, "all_reduce");
    const CudaDeviceScope cuda(device());
    NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor),
                             op == ReduceOp::Sum ? ncclSum : ncclMax, nccl_, cuda.stream()));
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    check_device_buffer(tensor, "broadcast");
    check_peer(root, "broadcast (root)");
    check_same_on_every_rank(*this, tensor, "broadcast");
    const CudaDeviceScope cuda(device());
    NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), root, nccl_,
                             cuda.stream()));
  }

  void barrier() override {
    {
      const CudaDeviceScope cuda(device());
      CUDA_CHECK(cudaStreamSynchronize(cuda.stream()));
    }
    MPI_CHECK(MPI_Barrier(mpi_));
  }

  // all_to_all: the generic one, a grouped ncclSend/ncclRecv per peer through start().

  std::shared_ptr<Comm> split(int color, int key) override {
    CP_CHECK(color >= 0, "split: color must be >= 0, got ", color);
    return std::make_shared<NcclComm>(*this, color, key);
  }

 private:
  torch::Device device() const { return {torch::kCUDA, static_cast<c10::DeviceIndex>(device_)}; }

  void check_device_buffer(const torch::Tensor& tensor, const char* what) const {
    check_buffer(tensor, what);
    CP_CHECK(tensor.is_cuda() && tensor.device().index() == device_, what, ": the nccl backend moves tensors on cuda:",
             device_, " (this rank's GPU), got a tensor on ", tensor.device(), "; use the mpi backend for CPU tensors");
  }

  /// One GPU per rank: use_node_gpu gave each process of a node its own GPU while the node has
  /// enough. NCCL cannot run two ranks on one GPU ("Duplicate GPU detected"), so every rank
  /// compares its (host, PCI bus id) with the others' and the world refuses to start if two are
  /// the same.
  void check_one_rank_per_gpu() const {
    constexpr int kKey = 128;
    char key[kKey] = {};
    gethostname(key, kKey / 2);
    const size_t host_length = std::strlen(key);
    key[host_length] = '/';
    CUDA_CHECK(cudaDeviceGetPCIBusId(key + host_length + 1, kKey - static_cast<int>(host_length) - 1, device_));
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
