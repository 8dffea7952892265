// Requests merged into batches before the router: for a model the router says may be merged (a model it
// batches, an ensemble whose every step it batches), the front sends a request at once while fewer than a few of that model's
// requests are at the router, and otherwise queues it; when one comes back, the queued requests that may share
// a request (the same model, caller, input names, datatypes and trailing shapes, and requested outputs) go as
// one, their inputs joined along dimension 0, and its answer is split back by rows. The router's Python
// then does its per-request work once per batch (pipeline.runtime.frame_server counts each request).
#pragma once

#include <grpcpp/support/slice.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "door.h"

namespace front {

// The parameters the router and the front speak of batches in (pipeline.protocol.frames).
constexpr std::string_view kFrontBatchParameter = "pipeline.front_batch";
constexpr std::string_view kMergedParameter = "pipeline.merged";
constexpr std::string_view kResendParameter = "pipeline.resend_alone";

// What merging needs of a ModelInferRequest that may be merged: views into its bytes.
struct Mergeable {
  struct Input {
    std::string_view name, datatype;
    std::vector<int64_t> shape;
    std::string_view raw;
  };
  std::string_view model_name, model_version;
  std::vector<Input> inputs;
  std::vector<std::string_view> outputs;  // each requested output's field, tag and all
  int64_t rows = 0;                       // dimension 0 of every input
  size_t bytes = 0;                       // the message's size
  std::string key;                        // requests of equal keys may share a batch
};

// `message` read as a request that may be merged, for the caller `caller` (its credentials): all its inputs
// raw, their bytes agreeing with their shapes (fixed-size datatypes, or BYTES elements), one dimension 0, no parameters (of the
// request, its inputs or its outputs). Nothing where it may not (it then goes alone).
std::optional<Mergeable> MergeableOf(std::string_view message, std::string_view caller);

// One request the batcher holds: the front's call for it.
class Member {
 public:
  virtual ~Member() = default;
  virtual const Mergeable& mergeable() const = 0;
  // The client's id of its request ("" for none).
  virtual const std::string& id() const = 0;
  // The time its client still waits, in microseconds; 0 for no deadline.
  virtual int64_t TimeLeftUs() const = 0;
  // Its credentials as the hop's parameters (authorization and identities), as every request carries them.
  virtual const std::string& credentials() const = 0;
  // Send it as it came, waiting for its own answer; `tracked`: the batcher counts it in flight.
  virtual void SendAlone(bool tracked) = 0;
  // Its answer: the ModelInferResponse's pieces.
  virtual void Reply(std::vector<grpc::Slice> pieces) = 0;
  virtual void End(const grpc::Status& status) = 0;
};

// A failed request's status from the router's answer: the google.rpc.Status its response carries (code,
// message and details), else UNKNOWN with its error message.
grpc::Status StatusOf(std::string_view message, std::string_view reply);

class Batch;

// Every model's queue and its requests in flight at the router.
class Batcher {
 public:
  // `max_bytes`: the largest message a merged request may be (the router's limit).
  Batcher(Door& door, int inflight, size_t max_bytes) : door_(door), inflight_(inflight), max_bytes_(max_bytes) {}
  // The most items a merged request of `model` may carry as the router last said (0: none may be merged).
  int64_t Limit(const std::string& model);
  // The router's answer to a request of `model` said `limit` (0 where it said nothing).
  void Learn(const std::string& model, int64_t limit);
  // Take a request of `model` (whose limit is positive): sent at once, or queued. The queue holds at most
  // what fills the batches in flight again (`inflight` batches of the limit's rows and the largest message's
  // bytes); a request past that goes to the router alone at once, where the router's own limits (its
  // in-flight requests, its byte budget) take it or refuse it: a flood waits at the router's door, not here.
  void Submit(const std::string& model, Member* member);
  // A request or batch of `model` the batcher sent is answered (or failed, or given up): the queue moves on.
  void Done(const std::string& model);
  // A member's client has gone: true where it was still queued (taken out: the caller ends it); else it
  // is in a batch (which then answers it CANCELLED) or sent alone.
  bool Withdraw(const std::string& model, Member* member, std::shared_ptr<Batch>& batch);
  Door& door() { return door_; }

 private:
  struct Model {
    int64_t limit = 0;
    int inflight = 0;
    std::deque<Member*> queue;
    int64_t queued_rows = 0;  // the rows and bytes of the requests in `queue`
    size_t queued_bytes = 0;
    std::unordered_map<Member*, std::shared_ptr<Batch>> batched;  // members of the batches in flight
  };
  // Under the lock: the next batch of the queue (one member or more).
  std::vector<Member*> Take(Model& state);
  // Under the lock: `member` is no longer queued.
  static void Dequeued(Model& state, const Member* member);
  void Send(const std::string& model, std::vector<Member*> members);
  friend class Batch;

  Door& door_;
  int inflight_;
  size_t max_bytes_;
  std::mutex mutex_;
  std::unordered_map<std::string, Model> models_;
};

// Requests sent as one: the merged request's answer split back by rows.
class Batch final : public Waiter, public std::enable_shared_from_this<Batch> {
 public:
  Batch(Batcher& batcher, std::string model, std::vector<Member*> members);
  void Send();
  // A member's client has gone: it is answered CANCELLED with the rest; where every member has gone, the
  // router is told to stop the batch.
  void Leave(Member* member);
  void Answer(grpc::Slice payload) override;
  void Fail(const grpc::Status& status) override;

 private:
  // The batch is over: each member answered by `answer` (CANCELLED where its client went), the batcher told.
  template <typename F>
  void Complete(F answer);
  bool Split(const grpc::Slice& payload, std::string_view reply, std::vector<std::vector<grpc::Slice>>& replies);

  Batcher& batcher_;
  std::string model_;
  std::vector<Member*> members_;
  std::mutex mutex_;
  std::vector<bool> left_;
  size_t leaving_ = 0;
  bool over_ = false;
  std::shared_ptr<Connection> connection_;
  std::string key_;
  std::shared_ptr<Batch> self_;  // held while the router has it
};

}  // namespace front
