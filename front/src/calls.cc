#include "calls.h"

#include <grpcpp/security/auth_context.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string_view>
#include <vector>

#include "wire.h"

namespace front {

namespace {

constexpr std::string_view kModelInfer = "/inference.GRPCInferenceService/ModelInfer";
// Metadata the router takes from the front alone: a client's own is dropped.
constexpr char kSecretHeader[] = "pipeline-door";
constexpr char kIdentitiesHeader[] = "pipeline-peer-identities";
// Request parameters of the hop (pipeline/protocol/streams.py and the frame server's door): the deadline as
// time left, the trace context and call chain, and the caller's credentials.
constexpr char kTimeoutParameter[] = "pipeline.timeout_us";
constexpr char kAuthorization[] = "authorization";
constexpr char kIdentitiesParameter[] = "pipeline.peer_identities";
constexpr const char* kTraceHeaders[] = {"traceparent", "tracestate", "pipeline-call-chain"};

std::string_view View(const grpc::string_ref& ref) { return {ref.data(), ref.size()}; }

// The identities of the call's verified client certificate (subject CN and alternative names).
std::vector<std::string> IdentitiesOf(const grpc::ServerContextBase& context) {
  std::vector<std::string> names;
  auto auth = context.auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return names;
  for (const char* property : {"x509_common_name", "x509_subject_alternative_name"})
    for (const auto& value : auth->FindPropertyValues(property)) names.emplace_back(value.data(), value.size());
  return names;
}

// The time the client still waits, in microseconds; 0 where it set no deadline.
int64_t TimeLeftOf(const grpc::ServerContextBase& context) {
  auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return 0;
  auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - std::chrono::system_clock::now());
  return std::max<int64_t>(1, left.count());
}

// A ModelInfer, handed to the router as a frame: its bytes as they came, followed by the hop's parameters
// and an id of the connection's own, the client's id written back into the answer. A request of a model the
// router lets the front merge goes through the batcher (batches.h), alone or in a batch.
class InferCall final : public grpc::ServerGenericBidiReactor, public Waiter, public Member {
 public:
  InferCall(grpc::GenericCallbackServerContext* context, Door& door, Batcher& batcher, const Settings& settings)
      : context_(context), door_(door), batcher_(batcher), settings_(settings) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ModelInfer: the call ended before its request came"));
      return;
    }
    if (!request_.Dump(&body_).ok()) {
      FinishOnce(grpc::Status(grpc::StatusCode::INTERNAL, "the front could not read the request"));
      return;
    }
    std::string_view message;
    if (body_.size() == 1) {
      message = {reinterpret_cast<const char*>(body_[0].begin()), body_[0].size()};
    } else {
      for (const auto& slice : body_) joined_.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      body_ = {grpc::Slice(joined_)};
      message = {reinterpret_cast<const char*>(body_[0].begin()), body_[0].size()};
    }
    // The client's id, to be given back in the answer (the last of the field, as protobuf reads it), and the
    // model it asks for.
    std::string_view name, version;
    wire::Reader fields(message);
    wire::Field field;
    while (fields.Next(field)) {
      if (field.type != wire::kLengthDelimited) continue;
      if (field.number == 3) id_ = std::string(field.bytes);
      else if (field.number == 1) name = field.bytes;
      else if (field.number == 2) version = field.bytes;
      else if (field.number == 4 && !claims_merged_) {
        auto key = wire::FindField(field.bytes, 1);
        claims_merged_ = key && key->bytes == kMergedParameter;
      }
    }
    if (fields.failed()) {
      FinishOnce(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ModelInfer: the request is not a valid ModelInferRequest message"));
      return;
    }
    model_.append(name).push_back('\0');
    model_.append(version);
    credentials_ = Credentials();
    if (int64_t limit = batcher_.Limit(model_); limit > 0 && !Traced()) {
      mergeable_ = MergeableOf(message, credentials_);
      // A request that fills a batch alone goes as it came: waiting would gain it nothing.
      if (mergeable_ && mergeable_->rows < limit) {
        batched_ = true;
        batcher_.Submit(model_, this);
        return;
      }
    }
    SendAlone(false);
  }

  void OnCancel() override {
    std::shared_ptr<Connection> connection;
    std::string key;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      cancelled_ = true;
      connection = connection_;
      key = key_;
    }
    if (batched_) {
      std::shared_ptr<Batch> batch;
      if (batcher_.Withdraw(model_, this, batch)) {
        FinishOnce(grpc::Status::CANCELLED);
        return;
      }
      if (batch) {
        batch->Leave(this);  // it answers this call with the rest
        return;
      }
    }
    if (connection && connection->Forget(key)) EndWait(grpc::Status::CANCELLED);
  }

  void OnDone() override { Release(); }

  // --- Member ---

  const Mergeable& mergeable() const override { return *mergeable_; }
  const std::string& id() const override { return id_; }
  int64_t TimeLeftUs() const override { return TimeLeftOf(*context_); }
  const std::string& credentials() const override { return credentials_; }

  // Sent from a reaction (OnReadDone) or by the batcher on another call's thread: its answer may finish
  // the call before this returns, so the call is held (`owners_`) until it does.
  void SendAlone(bool tracked) override {
    owners_.fetch_add(1);
    tracked_ = tracked;
    auto connection = door_.Pick();
    std::string key = connection ? connection->Send(body_, HopParameters(), this) : "";
    if (key.empty()) {
      EndWait(grpc::Status(grpc::StatusCode::UNAVAILABLE, connection ? "the router's frame connection broke"
                                                                     : "the router is not reachable (its door has no connection)"));
      Release();
      return;
    }
    bool cancelled;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      connection_ = connection;
      key_ = key;
      cancelled = cancelled_;
    }
    if (cancelled && connection->Forget(key)) EndWait(grpc::Status::CANCELLED);
    Release();
  }

  void Reply(std::vector<grpc::Slice> pieces) override {
    if (finished_.exchange(true)) return;
    response_ = grpc::ByteBuffer(pieces.data(), pieces.size());
    StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void End(const grpc::Status& status) override { FinishOnce(status); }

  // --- Waiter: the answer to this request sent alone ---

  void Answer(grpc::Slice payload) override {
    std::string_view bytes(reinterpret_cast<const char*>(payload.begin()), payload.size());
    auto error = wire::FindField(bytes, 1);
    auto reply = wire::FindField(bytes, 2);
    if (error && !error->bytes.empty()) {
      EndWait(StatusOf(error->bytes, reply ? reply->bytes : std::string_view{}));
      return;
    }
    if (!reply) {
      EndWait(grpc::Status(grpc::StatusCode::INTERNAL, "the router answered without a response"));
      return;
    }
    // The response as the router made it but for its id, which becomes the client's again, and the
    // parameter that tells the front whether it may merge the model's requests, which is the front's.
    size_t base = static_cast<size_t>(reply->bytes.data() - bytes.data());
    std::vector<grpc::Slice> pieces;
    size_t from = 0;
    bool placed = false;
    int64_t limit = 0;
    wire::Reader fields(reply->bytes);
    wire::Field field;
    while (fields.Next(field)) {
      if (field.type != wire::kLengthDelimited) continue;
      if (field.number == 4) {
        auto key = wire::FindField(field.bytes, 1);
        auto value = wire::FindField(field.bytes, 2);
        if (!key || key->bytes != kFrontBatchParameter) continue;
        if (value) limit = wire::Int64Parameter(value->bytes);
      } else if (field.number != 3) {
        continue;
      }
      if (field.begin > from) pieces.push_back(payload.sub(base + from, base + field.begin));
      if (field.number == 3 && !placed && !id_.empty()) {
        std::string id;
        wire::PutBytes(id, 3, id_);
        pieces.emplace_back(id);
      }
      placed = placed || field.number == 3;
      from = field.end;
    }
    if (from < reply->bytes.size()) pieces.push_back(payload.sub(base + from, base + reply->bytes.size()));
    if (!placed && !id_.empty()) {
      std::string id;
      wire::PutBytes(id, 3, id_);
      pieces.emplace_back(id);
    }
    batcher_.Learn(model_, limit);
    Batcher* tracking = tracked_ ? &batcher_ : nullptr;
    std::string model = tracking ? model_ : std::string();
    Reply(std::move(pieces));  // the call may be gone once it returns
    if (tracking) tracking->Done(model);
  }

  void Fail(const grpc::Status& status) override { EndWait(status); }

 private:
  void FinishOnce(const grpc::Status& status) {
    if (finished_.exchange(true)) return;
    Finish(status);  // the last thing done here: the call may be gone once it returns
  }

  // grpc++ is done with the call (OnDone), or a send that held it is over: the last of them deletes it.
  void Release() {
    if (owners_.fetch_sub(1) == 1) delete this;
  }

  // This request, sent alone, is over: the batcher told where it counted it in flight.
  void EndWait(const grpc::Status& status) {
    Batcher* tracking = tracked_ ? &batcher_ : nullptr;
    std::string model = tracking ? model_ : std::string();
    FinishOnce(status);
    if (tracking) tracking->Done(model);
  }

  // Whether the client sent trace context (it asks for this request to be traced: it goes alone).
  bool Traced() const {
    const auto& metadata = context_->client_metadata();
    for (const char* key : kTraceHeaders)
      if (metadata.find(key) != metadata.end()) return true;
    return false;
  }

  // The caller's credentials as the hop's parameters. They are always written, empty or not, so that a
  // client's own parameters of those names never count.
  std::string Credentials() const {
    std::string tail;
    const auto& metadata = context_->client_metadata();
    auto authorization = metadata.find(kAuthorization);
    wire::PutStringParameter(tail, kAuthorization,
                             authorization == metadata.end() ? std::string_view{} : View(authorization->second));
    std::string identities;
    if (settings_.client_certificates) {
      for (const auto& name : IdentitiesOf(*context_)) {
        if (!identities.empty()) identities.push_back('\n');
        identities += name;
      }
    }
    wire::PutStringParameter(tail, kIdentitiesParameter, identities);
    return tail;
  }

  // What the router needs of the call beyond its message: the deadline, trace context and credentials (and
  // that it carries one request, where the client's own parameters said otherwise).
  std::string HopParameters() const {
    std::string tail;
    if (int64_t left = TimeLeftOf(*context_); left > 0) wire::PutInt64Parameter(tail, kTimeoutParameter, left);
    const auto& metadata = context_->client_metadata();
    for (const char* key : kTraceHeaders) {
      auto found = metadata.find(key);
      if (found != metadata.end()) wire::PutStringParameter(tail, key, View(found->second));
    }
    tail += credentials_;
    if (claims_merged_) wire::PutInt64Parameter(tail, kMergedParameter, 1);
    return tail;
  }

  grpc::GenericCallbackServerContext* context_;
  Door& door_;
  Batcher& batcher_;
  const Settings& settings_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  std::vector<grpc::Slice> body_;
  std::string joined_;
  std::string id_;
  std::string model_;  // its name and version
  std::string credentials_;
  bool claims_merged_ = false;
  std::optional<Mergeable> mergeable_;
  std::atomic<bool> batched_{false};
  bool tracked_ = false;
  std::atomic<bool> finished_{false};
  std::atomic<int> owners_{1};  // grpc++, and each send under way
  std::mutex mutex_;
  bool cancelled_ = false;
  std::shared_ptr<Connection> connection_;
  std::string key_;
};

// Any other RPC, forwarded as it is to the router's gRPC port: messages both ways, metadata, the deadline,
// cancellation, and the router's status with its details.
//
// Two pumps move the messages: the client's to the router, the router's to the client. The router's call
// holds two holds, one for each pump, so that it is never done (its OnDone called, after which nothing may
// be started on it) while a pump may still start something on it; the client's call is finished only once
// the router's is done, when both pumps are over.
class ProxyCall final : public grpc::ServerGenericBidiReactor {
 public:
  ProxyCall(grpc::GenericCallbackServerContext* context, grpc::GenericStub& stub, const Settings& settings)
      : context_(context), upstream_(this) {
    for (const auto& [key, value] : context->client_metadata()) {
      std::string name(key.data(), key.size());
      if (name == kSecretHeader || name == kIdentitiesHeader || name == "user-agent" || name == "te" ||
          name == "content-type" || name.rfind("grpc-", 0) == 0 || name.rfind(":", 0) == 0)
        continue;
      client_.AddMetadata(name, std::string(value.data(), value.size()));
    }
    // The router's gRPC port behind the front answers calls that carry its secret alone.
    client_.AddMetadata(kSecretHeader, settings.secret);
    if (settings.client_certificates)
      for (const auto& name : IdentitiesOf(*context)) client_.AddMetadata(kIdentitiesHeader, name);
    if (context->deadline() != std::chrono::system_clock::time_point::max())
      client_.set_deadline(context->deadline());
    stub.PrepareBidiStreamingCall(&client_, context->method(), grpc::StubOptions(), &upstream_);
    upstream_.AddMultipleHolds(2);
    upstream_.StartRead(&from_router_);
    upstream_.StartCall();
    StartRead(&from_client_);
  }

  // The client's messages, on to the router (the first pump).
  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (sending_over_) return;  // the router has ended the call: what the client sends goes nowhere
    if (!ok) {
      upstream_.StartWritesDone();
      EndSending(lock);
      return;
    }
    upstream_.StartWrite(&from_client_);  // under the hold: the router's call cannot be done yet
  }
  void WroteToRouter(bool ok) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!ok || sending_over_ || finished_) {
      EndSending(lock);
      return;
    }
    StartRead(&from_client_);
  }

  // The router's messages, back to the client (the second pump).
  void ReadFromRouter(bool ok) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!ok) {  // the router has sent all it will: its status follows, and the client's messages stop here
      EndSending(lock);
      if (lock.owns_lock()) lock.unlock();
      upstream_.RemoveHold();
      return;
    }
    if (!sent_metadata_) CopyInitialMetadata();
    StartWrite(&from_router_);
  }
  void OnWriteDone(bool ok) override {
    if (ok) {
      upstream_.StartRead(&from_router_);
      return;
    }
    client_.TryCancel();  // the client is gone
    upstream_.RemoveHold();
  }

  void RouterDone(const grpc::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_ = true;
      if (!sent_metadata_) CopyInitialMetadata();
    }
    for (const auto& [key, value] : client_.GetServerTrailingMetadata()) {
      std::string name(key.data(), key.size());
      if (name == "grpc-status-details-bin") continue;  // the status carries its details itself
      context_->AddTrailingMetadata(name, std::string(value.data(), value.size()));
    }
    Finish(status);
    Release();
  }

  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { Release(); }

 private:
  class Upstream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Upstream(ProxyCall* call) : call_(call) {}
    void OnReadDone(bool ok) override { call_->ReadFromRouter(ok); }
    void OnWriteDone(bool ok) override { call_->WroteToRouter(ok); }
    void OnDone(const grpc::Status& status) override { call_->RouterDone(status); }

   private:
    ProxyCall* call_;
  };

  // The first pump is over: its hold on the router's call goes (once), outside the lock.
  void EndSending(std::unique_lock<std::mutex>& lock) {
    if (sending_over_) return;
    sending_over_ = true;
    lock.unlock();
    upstream_.RemoveHold();
  }

  void CopyInitialMetadata() {
    sent_metadata_ = true;
    for (const auto& [key, value] : client_.GetServerInitialMetadata())
      context_->AddInitialMetadata(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
  }

  // Both sides are done with the call: the client's (OnDone) and the router's (RouterDone).
  void Release() {
    if (owners_.fetch_sub(1) == 1) delete this;
  }

  grpc::GenericCallbackServerContext* context_;
  grpc::ClientContext client_;
  Upstream upstream_;
  grpc::ByteBuffer from_client_, from_router_;
  std::mutex mutex_;
  bool sending_over_ = false, finished_ = false, sent_metadata_ = false;
  std::atomic<int> owners_{2};
};

}  // namespace

grpc::ServerGenericBidiReactor* Service::CreateReactor(grpc::GenericCallbackServerContext* context) {
  if (context->method() == kModelInfer) return new InferCall(context, door_, batcher_, settings_);
  return new ProxyCall(context, stub_, settings_);
}

}  // namespace front
