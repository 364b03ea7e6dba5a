// cp::Comm — the one communication interface of the course, modelled on torch.distributed.
//
// Buffers are torch::Tensor (contiguous). Three backends implement it: `local` (ranks are
// threads of one process), `mpi` (one process per rank under mpirun) and `nccl` (one GPU per
// rank). Collectives have a generic implementation on top of point-to-point; backends with
// native collectives override them.
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace cp {

enum class Backend { Local, Mpi, Nccl };
enum class ReduceOp { Sum, Max };

std::string to_string(Backend backend);
/// Parses "local", "mpi" or "nccl"; anything else is a cp::Error listing the choices.
Backend parse_backend(const std::string& name);

/// One point-to-point operation of a batch passed to Comm::start().
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind;
  torch::Tensor tensor;  ///< contiguous; a receive writes into it
  int peer;

  static P2POp send(torch::Tensor tensor, int peer) { return {Kind::Send, std::move(tensor), peer}; }
  static P2POp recv(torch::Tensor tensor, int peer) { return {Kind::Recv, std::move(tensor), peer}; }
};

namespace detail {
/// What a backend keeps for a batch in flight.
class PendingBatch {
 public:
  virtual ~PendingBatch() = default;
  virtual void wait() = 0;
};
}  // namespace detail

/// Handle of a batch started with Comm::start(). wait() returns when every operation of the
/// batch is complete (for device tensors: when the caller's current stream is ordered after
/// it). Waiting twice is a no-op.
class Request {
 public:
  Request() = default;
  explicit Request(std::unique_ptr<detail::PendingBatch> batch) : batch_(std::move(batch)) {}
  void wait();

 private:
  std::unique_ptr<detail::PendingBatch> batch_;
};

/// A communicator over `size()` ranks.
class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;

  /// Blocking send with rendezvous semantics: returns once `peer` has taken the data. Two
  /// ranks that both send to each other first therefore deadlock (lesson 06).
  virtual void send(const torch::Tensor& tensor, int peer) = 0;
  /// Blocking receive into `tensor` (same dtype and number of elements as the send).
  virtual void recv(torch::Tensor& tensor, int peer) = 0;
  /// Starts a batch of non-blocking sends and receives (an NCCL group, MPI Isend/Irecv).
  /// Tensors must stay alive and untouched until the request is waited on.
  virtual Request start(const std::vector<P2POp>& ops) = 0;

  /// Sends `send_tensor` to `dst` while receiving `recv_tensor` from `src`, without deadlock.
  void sendrecv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor, int src);

  /// Concatenation along dim 0 of every rank's tensor (same shape on every rank), in rank order.
  virtual torch::Tensor all_gather(const torch::Tensor& tensor);
  /// Sum over ranks, split along dim 0 (divisible by size()): rank r gets the r-th part.
  virtual torch::Tensor reduce_scatter(const torch::Tensor& tensor);
  /// In-place reduction over ranks; every rank ends with the same values.
  virtual void all_reduce(torch::Tensor& tensor, ReduceOp op);
  /// In-place copy of `root`'s tensor to every rank.
  virtual void broadcast(torch::Tensor& tensor, int root);
  /// Returns once every rank has called it.
  virtual void barrier();
  /// Personalised exchange (torch.distributed's all_to_all_single with equal splits): dim 0 of
  /// `tensor` (same shape on every rank) is cut into size() equal parts; part p goes to rank p,
  /// and part p of the result is what rank p sent to this rank. Dim 0 must be divisible by size().
  virtual torch::Tensor all_to_all(const torch::Tensor& tensor);

  /// A sub-communicator (MPI_Comm_split): collective over this Comm. The ranks that pass the same
  /// `color` (>= 0) form one new Comm, ranked by `key`, ties broken by the rank here. The result
  /// is independent of this Comm: messages of one never match receives of the other, and both
  /// can be used concurrently; every rank must call split() on a Comm in the same order.
  virtual std::shared_ptr<Comm> split(int color, int key) = 0;

  /// Expires when this Comm is destroyed. A cache of what was made from a Comm (lesson 11's
  /// hybrid_strategy keeps the communicators it split off) keys on it, not on the Comm's address:
  /// a Comm made later at the same address (the next world's rank) must not find the old entry.
  std::weak_ptr<const void> lifetime() const { return lifetime_; }

 protected:
  /// Checks a peer index and a P2P buffer; `what` names the calling function in the message.
  void check_peer(int peer, const char* what) const;
  static void check_buffer(const torch::Tensor& tensor, const char* what);

 private:
  std::shared_ptr<const void> lifetime_ = std::make_shared<char>();  // see lifetime()
};

}  // namespace cp
