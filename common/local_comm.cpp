// The `local` backend: N ranks as threads of one process.
//
// Point-to-point operations are matched in the order they were posted, per (sender, receiver)
// pair, like MPI. The copy into a receive buffer is made by the rank that owns it if that rank is
// already waiting for it (it has nothing else to do), else by the thread that posts the second
// half of the pair: a memcpy for CPU tensors; for CUDA tensors an asynchronous copy on the receiver's copy stream, ordered
// after both buffers are ready (events recorded on each rank's current stream) and waited on
// by stream, not by the host, so compute and communication overlap on one GPU.
//
// A blocking send returns only when its receive has been matched (rendezvous), which is what
// makes a naive ring deadlock. The watchdog turns that into cp::DeadlockError: when every live
// rank is blocked on unmatched operations, nothing can ever change again.
//
// Sub-communicators (Comm::split) live in the same world: each Comm has a context number, and
// an operation only matches one of the same context (MPI's rule). Operations name world ranks
// internally, so the watchdog sees every rank's waits, whichever communicator they are on.
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>

#include "common/device.h"
#include "common/error.h"
#include "common/world.h"

#if CP_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "common/cuda_check.h"
#endif

namespace cp {
namespace {

using Clock = std::chrono::steady_clock;

/// A point in a device stream (a CUDA event); empty for CPU tensors, which need no ordering.
struct Fence {
  std::shared_ptr<void> event;  // cudaEvent_t, destroyed with the last copy of the fence

  /// Marks "everything enqueued so far on the current stream of t's device".
  static Fence after_current_work(const torch::Tensor& t) {
    if (!t.is_cuda()) return {};
#if CP_TORCH_CUDA
    c10::cuda::CUDAGuard guard(t.device());
    cudaEvent_t event;
    CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(event, current_cuda_stream()));
    return {std::shared_ptr<void>(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); })};
#else
    CP_FAIL("local backend: CUDA tensors need a build with CUDA and a CUDA LibTorch");
#endif
  }

  /// Makes the caller's current stream wait for this fence (the host does not wait).
  void order_current_stream(const torch::Tensor& t) const {
#if CP_TORCH_CUDA
    if (!event) return;
    c10::cuda::CUDAGuard guard(t.device());
    CUDA_CHECK(cudaStreamWaitEvent(current_cuda_stream(), static_cast<cudaEvent_t>(event.get()), 0));
#else
    (void)t;
#endif
  }
};

/// The streams that copy into one rank's buffers, one per device: separate from the rank's
/// compute stream, so that incoming data moves while the rank computes. Several senders copy
/// into the same rank at once (outside the world's lock), so a stream is created once, under
/// this object's lock, and each copy reads it once and uses it for its wait, copy and record.
class CopyStream {
 public:
  CopyStream() = default;
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  ~CopyStream() {
#if CP_TORCH_CUDA
    for (const auto& [device, stream] : streams_) (void)cudaStreamDestroy(stream);
#endif
  }

  /// Copies src into dst (same byte size) after both fences; returns the copy's completion.
  Fence copy(const torch::Tensor& dst, const torch::Tensor& src, const Fence& src_ready,
             const Fence& dst_ready) {
    const size_t bytes = src.numel() * src.element_size();
    if (!dst.is_cuda()) {
      if (bytes > 0) std::memcpy(dst.data_ptr(), src.data_ptr(), bytes);
      return {};
    }
#if CP_TORCH_CUDA
    c10::cuda::CUDAGuard guard(dst.device());
    const cudaStream_t stream = stream_for(dst.device().index());
    for (const Fence* f : {&src_ready, &dst_ready})
      if (f->event) CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(f->event.get()), 0));
    CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), bytes, cudaMemcpyDefault, stream));
    // Neither buffer may go to another tensor before the copy is done, whenever its rank frees
    // it: a batch destroyed without wait() (its rank threw) drops its tensors at once, and so
    // does the world for a send whose batch is gone by the time it is matched. The allocator
    // then waits for this stream; no host thread waits.
    record_stream_use(dst, stream, dst.device());
    record_stream_use(src, stream, dst.device());
    cudaEvent_t done;
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(done, stream));
    return {std::shared_ptr<void>(done, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); })};
#else
    (void)src_ready, (void)dst_ready;
    CP_FAIL("local backend: CUDA tensors need a build with CUDA and a CUDA LibTorch");
#endif
  }

 private:
#if CP_TORCH_CUDA
  /// The copy stream of `device` (the current device), created on first use.
  cudaStream_t stream_for(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    cudaStream_t& stream = streams_[device];
    if (stream == nullptr) CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  std::mutex mutex_;
  std::map<int, cudaStream_t> streams_;  // device index -> stream
#endif
};

/// One posted send or receive.
struct PendingOp {
  P2POp::Kind kind;
  torch::Tensor tensor;  // contiguous
  int context;           // the communicator it was posted on (0: the world)
  int owner;             // the world rank that posted it
  int peer;              // the world rank of the other side
  Fence ready;           // the owner's buffer is ready (device tensors)
  bool done = false;     // matched and copied (or failed)
  Fence completed;       // the copy has finished on the device
  std::string error;     // why the match failed, if it did
  std::shared_ptr<PendingOp> copy_from;  // a receive: its matched send, which its owner copies in wait()

  std::string edge() const {
    return "rank " + std::to_string(owner) + (kind == P2POp::Kind::Send ? " send→" : " recv←") +
           std::to_string(peer);
  }
};
using OpPtr = std::shared_ptr<PendingOp>;

std::string describe_tensor(const torch::Tensor& t) {
  return detail::concat(t.numel(), " ", t.dtype(), " elements on ", t.device());
}

/// State shared by the ranks of one local world.
class LocalWorld {
 public:
  LocalWorld(int size, LocalWorldOptions options) : size_(size), options_(options), ranks_(size) {}

  int size() const { return size_; }

  /// The context of the communicator that ranks calling `parent`'s split number `split` with
  /// `color` form: the first of them allocates it, the others find it.
  int context_for(int parent, int64_t split, int color) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto [it, inserted] = contexts_.try_emplace({parent, split, color}, static_cast<int>(contexts_.size()) + 1);
    return it->second;
  }

  /// Queues an operation; if it completes a pair, copies the data (outside the lock).
  void post(const OpPtr& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    throw_if_aborted();
    const bool is_send = op->kind == P2POp::Kind::Send;
    const Channel channel{op->context, is_send ? op->owner : op->peer, is_send ? op->peer : op->owner};
    std::deque<OpPtr>& sends = sends_[channel];
    std::deque<OpPtr>& recvs = recvs_[channel];
    (is_send ? sends : recvs).push_back(op);
    if (sends.empty() || recvs.empty()) return;
    const OpPtr send = sends.front();
    const OpPtr recv = recvs.front();
    sends.pop_front();
    recvs.pop_front();
    const std::vector<OpPtr>& receiver_waits = ranks_[recv->owner].waiting_on;
    if (op == send && std::find(receiver_waits.begin(), receiver_waits.end(), recv) != receiver_waits.end()) {
      // The receiver waits for this very receive: it copies, and this rank goes on. In a batched
      // ring step every rank then copies its own incoming chunk, all at once, where the last
      // rank to post would otherwise make two copies while its neighbour sits idle.
      recv->copy_from = send;
      last_change_ = Clock::now();
      changed_.notify_all();
      return;
    }
    copy_pair(lock, send, recv);
  }

  /// Copies a matched pair's data with `lock` released, then marks both done.
  void copy_pair(std::unique_lock<std::mutex>& lock, const OpPtr& send, const OpPtr& recv) {
    CopyStream& stream = *ranks_[recv->owner].incoming;
    lock.unlock();

    std::string error;
    Fence completed;
    try {
      error = mismatch(*send, *recv);
      if (error.empty()) completed = stream.copy(recv->tensor, send->tensor, send->ready, recv->ready);
    } catch (const std::exception& e) {
      error = e.what();
    }

    lock.lock();
    for (const OpPtr& o : {send, recv}) {
      o->done = true;
      o->error = error;
      o->completed = completed;
    }
    last_change_ = Clock::now();
    changed_.notify_all();
  }

  /// Blocks `rank` until all `ops` are done; throws on abort, deadlock or a failed match.
  void wait(int rank, const std::vector<OpPtr>& ops) {
    std::unique_lock<std::mutex> lock(mutex_);
    RankState& me = ranks_[rank];
    me.waiting_on = ops;
    last_change_ = Clock::now();
    const auto poll = std::max(std::chrono::milliseconds(1), options_.deadlock_timeout / 10);
    while (true) {
      if (aborted_) {
        me.waiting_on.clear();
        throw_if_aborted();
      }
      for (const OpPtr& o : ops) {
        if (!o->copy_from) continue;
        const OpPtr send = std::move(o->copy_from);
        o->copy_from.reset();
        copy_pair(lock, send, o);
      }
      if (std::all_of(ops.begin(), ops.end(), [](const OpPtr& o) { return o->done; })) break;
      if (every_live_rank_stuck() && Clock::now() - last_change_ >= options_.deadlock_timeout) {
        aborted_ = true;
        deadlocked_ = true;
        abort_message_ = describe_deadlock();
        changed_.notify_all();
        continue;
      }
      changed_.wait_for(lock, poll);
    }
    me.waiting_on.clear();
    last_change_ = Clock::now();
    lock.unlock();
    for (const OpPtr& o : ops) {
      if (!o->error.empty()) throw Error(o->error);
      o->completed.order_current_stream(o->tensor);
    }
  }

  /// Withdraws the receives of a batch abandoned before wait() (its rank threw) that no send
  /// has matched yet, as MPI_Cancel does: the peer's message then goes to this rank's next
  /// receive instead of into a tensor nobody reads. Unmatched sends stay, as on MPI.
  void withdraw_receives(const std::vector<OpPtr>& ops) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const OpPtr& op : ops) {
      if (op->done || op->kind != P2POp::Kind::Recv) continue;
      std::deque<OpPtr>& queue = recvs_[{op->context, op->peer, op->owner}];
      queue.erase(std::remove(queue.begin(), queue.end(), op), queue.end());
    }
  }

  void finish(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    ranks_[rank].finished = true;
    last_change_ = Clock::now();
    changed_.notify_all();
  }

  void abort(int rank, const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    ranks_[rank].finished = true;
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = "released because rank " + std::to_string(rank) + " failed: " + what;
    }
    changed_.notify_all();
  }

 private:
  struct RankState {
    bool finished = false;
    std::vector<OpPtr> waiting_on;  // non-empty while blocked in wait()
    std::unique_ptr<CopyStream> incoming = std::make_unique<CopyStream>();
  };

  void throw_if_aborted() const {
    if (!aborted_) return;
    if (deadlocked_) throw DeadlockError(abort_message_);
    throw WorldAborted(abort_message_);
  }

  static std::string mismatch(const PendingOp& send, const PendingOp& recv) {
    if (send.tensor.numel() == recv.tensor.numel() && send.tensor.dtype() == recv.tensor.dtype() &&
        send.tensor.is_cuda() == recv.tensor.is_cuda())
      return "";
    return detail::concat("send/recv mismatch: rank ", send.owner, " sends ", describe_tensor(send.tensor),
                          " to rank ", recv.owner, ", which receives into ", describe_tensor(recv.tensor),
                          " (element count, dtype and device kind must agree)");
  }

  static const PendingOp* first_unmatched(const RankState& r) {
    for (const OpPtr& o : r.waiting_on)
      if (!o->done && !o->copy_from) return o.get();  // a receive with its send's copy pending is not stuck
    return nullptr;
  }

  bool every_live_rank_stuck() const {
    bool any_stuck = false;
    for (const RankState& r : ranks_) {
      if (r.finished) continue;
      if (!first_unmatched(r)) return false;  // running, or about to wake up
      any_stuck = true;
    }
    return any_stuck;
  }

  /// "rank 0 send→1, rank 1 send→2, rank 2 send→0", found by following wait-for edges.
  std::string describe_deadlock() const {
    std::string blocked, finished;
    int start = -1;
    for (int r = 0; r < size_; ++r) {
      if (ranks_[r].finished) {
        finished += (finished.empty() ? "" : ", ") + std::to_string(r);
      } else if (const PendingOp* op = first_unmatched(ranks_[r])) {
        blocked += (blocked.empty() ? "" : ", ") + op->edge();
        if (start < 0) start = r;
      }
    }
    std::vector<int> path;
    std::string cycle;
    for (int r = start; r >= 0 && !ranks_[r].finished;) {
      const auto seen = std::find(path.begin(), path.end(), r);
      if (seen != path.end()) {
        for (auto it = seen; it != path.end(); ++it)
          cycle += (cycle.empty() ? "" : ", ") + first_unmatched(ranks_[*it])->edge();
        break;
      }
      path.push_back(r);
      r = first_unmatched(ranks_[r])->peer;
    }
    std::string message = detail::concat(
        "deadlock: every live rank has been blocked in a point-to-point call for ",
        options_.deadlock_timeout.count(), " ms and none can proceed. ");
    if (!cycle.empty()) message += "Wait-for cycle: " + cycle + ". ";
    message += "Blocked: " + blocked + ".";
    if (!finished.empty()) message += " Ranks that already returned (nobody will answer for them): " + finished + ".";
    return message;
  }

  const int size_;
  const LocalWorldOptions options_;
  std::mutex mutex_;
  std::condition_variable changed_;
  using Channel = std::tuple<int, int, int>;  // context, sending world rank, receiving world rank
  std::map<Channel, std::deque<OpPtr>> sends_, recvs_;  // posted, not yet matched, in order
  std::map<std::tuple<int, int64_t, int>, int> contexts_;  // (parent context, split number, color) -> context
  std::vector<RankState> ranks_;
  bool aborted_ = false;
  bool deadlocked_ = false;
  std::string abort_message_;
  Clock::time_point last_change_ = Clock::now();
};

class LocalBatch : public detail::PendingBatch {
 public:
  LocalBatch(std::shared_ptr<LocalWorld> world, int world_rank, std::vector<OpPtr> ops)
      : world_(std::move(world)), world_rank_(world_rank), ops_(std::move(ops)) {}
  ~LocalBatch() override {
    if (!waited_) world_->withdraw_receives(ops_);
  }
  void wait() override {
    waited_ = true;
    world_->wait(world_rank_, ops_);
  }

 private:
  std::shared_ptr<LocalWorld> world_;
  int world_rank_;
  std::vector<OpPtr> ops_;
  bool waited_ = false;
};

class LocalComm : public Comm {
 public:
  /// Rank `rank` of the communicator `context` whose ranks are the world ranks `members`.
  LocalComm(std::shared_ptr<LocalWorld> world, std::vector<int> members, int rank, int context)
      : world_(std::move(world)), members_(std::move(members)), rank_(rank), context_(context) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  Backend backend() const override { return Backend::Local; }

  std::shared_ptr<Comm> split(int color, int key) override {
    CP_CHECK(color >= 0, "split: color must be >= 0, got ", color);
    const torch::Tensor mine = torch::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)});
    const torch::Tensor all = all_gather(mine).view({size(), 2});  // [rank][color, key]
    const auto colors = all.select(1, 0), keys = all.select(1, 1);
    std::vector<int> group;  // ranks of this Comm with my color, by (key, rank)
    for (int r = 0; r < size(); ++r)
      if (colors[r].item<int64_t>() == color) group.push_back(r);
    std::stable_sort(group.begin(), group.end(),
                     [&](int a, int b) { return keys[a].item<int64_t>() < keys[b].item<int64_t>(); });
    std::vector<int> members;
    for (int r : group) members.push_back(members_[r]);
    const int new_rank = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
    const int context = world_->context_for(context_, splits_++, color);
    return std::make_shared<LocalComm>(world_, std::move(members), new_rank, context);
  }

  void send(const torch::Tensor& tensor, int peer) override {
    world_->wait(members_[rank_], {post(P2POp::send(tensor, peer), "send")});
  }
  void recv(torch::Tensor& tensor, int peer) override {
    world_->wait(members_[rank_], {post(P2POp::recv(tensor, peer), "recv")});
  }
  Request start(const std::vector<P2POp>& ops) override {
    std::vector<OpPtr> posted;
    for (const P2POp& op : ops) posted.push_back(post(op, "start"));
    return Request(std::make_unique<LocalBatch>(world_, members_[rank_], std::move(posted)));
  }

 private:
  OpPtr post(const P2POp& op, const char* what) {
    check_peer(op.peer, what);
    check_buffer(op.tensor, what);
    auto pending = std::make_shared<PendingOp>(PendingOp{op.kind, op.tensor, context_, members_[rank_],
                                                         members_[op.peer], Fence::after_current_work(op.tensor),
                                                         false, {}, {}, {}});
    world_->post(pending);
    return pending;
  }

  std::shared_ptr<LocalWorld> world_;
  std::vector<int> members_;  // world rank of each rank of this Comm
  int rank_;
  int context_;
  int64_t splits_ = 0;  // split() calls so far: the same sequence on every rank
};

}  // namespace

void run_local_world(int world_size, const std::function<void(Comm&)>& fn,
                     const LocalWorldOptions& options) {
  CP_CHECK(world_size >= 1, "run_local_world: world_size must be >= 1, got ", world_size);
  auto world = std::make_shared<LocalWorld>(world_size, options);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      set_this_rank(r);
      run_backward_on_this_thread();  // lesson 09: a rank's backward communicates
      // N ranks share the machine's cores: one intra-op thread per rank avoids oversubscription.
      torch::set_num_threads(1);
      try {
        std::vector<int> everyone(world_size);
        std::iota(everyone.begin(), everyone.end(), 0);
        LocalComm comm(world, std::move(everyone), r, 0);
        fn(comm);
        world->finish(r);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        world->abort(r, e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        world->abort(r, "unknown exception");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // Report the rank that failed first in rank order, preferring a real failure over the
  // WorldAborted of the ranks it released.
  std::exception_ptr chosen;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    if (!chosen) chosen = e;
    try {
      std::rethrow_exception(e);
    } catch (const WorldAborted&) {
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  if (chosen) std::rethrow_exception(chosen);
}

}  // namespace cp
