#include "batches.h"

#include <algorithm>
#include <utility>

#include "wire.h"

namespace front {

namespace {

// Bytes per element of the fixed-size datatypes; BYTES (and anything else) is not merged.
size_t ItemSize(std::string_view datatype) {
  if (datatype == "BOOL" || datatype == "UINT8" || datatype == "INT8") return 1;
  if (datatype == "UINT16" || datatype == "INT16" || datatype == "FP16" || datatype == "BF16") return 2;
  if (datatype == "UINT32" || datatype == "INT32" || datatype == "FP32") return 4;
  if (datatype == "UINT64" || datatype == "INT64" || datatype == "FP64") return 8;
  return 0;
}

// A `repeated int64 shape` field's values (packed or not) appended to `shape`; false where malformed.
bool ReadDims(const wire::Field& field, std::vector<int64_t>& shape) {
  if (field.type == wire::kVarint) {
    shape.push_back(static_cast<int64_t>(field.varint));
    return true;
  }
  if (field.type != wire::kLengthDelimited) return false;
  std::string_view packed = field.bytes;
  size_t at = 0;
  while (at < packed.size()) {
    uint64_t value = 0;
    int shift = 0;
    for (;;) {
      if (at >= packed.size() || shift >= 64) return false;
      auto byte = static_cast<uint8_t>(packed[at++]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      shift += 7;
      if (!(byte & 0x80)) break;
    }
    shape.push_back(static_cast<int64_t>(value));
  }
  return true;
}

void PutShape(std::string& out, int64_t rows, const std::vector<int64_t>& shape) {
  std::string packed;
  wire::PutVarint(packed, static_cast<uint64_t>(rows));
  for (size_t d = 1; d < shape.size(); ++d) wire::PutVarint(packed, static_cast<uint64_t>(shape[d]));
  wire::PutBytes(out, 3, packed);
}

// Elements of a shape past dimension 0, or -1 where a dimension is negative or the count overflows.
int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (size_t d = 1; d < shape.size(); ++d) {
    if (shape[d] < 0 || (shape[d] > 0 && count > (int64_t{1} << 40) / shape[d])) return -1;
    count *= shape[d];
  }
  return count;
}

bool ReadInput(std::string_view bytes, Mergeable::Input& input) {
  wire::Reader fields(bytes);
  wire::Field field;
  while (fields.Next(field)) {
    if (field.number == 1 && field.type == wire::kLengthDelimited) input.name = field.bytes;
    else if (field.number == 2 && field.type == wire::kLengthDelimited) input.datatype = field.bytes;
    else if (field.number == 3) {
      if (!ReadDims(field, input.shape)) return false;
    } else return false;  // parameters, contents, or a field the protocol does not have
  }
  return !fields.failed() && !input.name.empty() && !input.shape.empty();
}

// Where each of `sizes` rows of a BYTES output's raw bytes begin (elements of a 4-byte little-endian
// length and the bytes), and the end; false where the bytes do not hold that many elements.
bool BytesRows(std::string_view raw, int64_t per_row, const std::vector<int64_t>& sizes, std::vector<size_t>& at) {
  size_t offset = 0;
  at.push_back(0);
  for (int64_t rows : sizes) {
    for (int64_t e = 0; e < rows * per_row; ++e) {
      if (raw.size() - offset < 4) return false;
      const auto* b = reinterpret_cast<const unsigned char*>(raw.data() + offset);
      uint32_t length = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
      if (raw.size() - offset - 4 < length) return false;
      offset += 4 + length;
    }
    at.push_back(offset);
  }
  return offset == raw.size();
}

grpc::Slice SliceOf(std::string bytes) {
  auto* owned = new std::string(std::move(bytes));
  return grpc::Slice(owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
}

}  // namespace

std::optional<Mergeable> MergeableOf(std::string_view message, std::string_view caller) {
  Mergeable request;
  request.bytes = message.size();
  std::vector<std::string_view> raws;
  wire::Reader fields(message);
  wire::Field field;
  while (fields.Next(field)) {
    if (field.type != wire::kLengthDelimited) return std::nullopt;
    switch (field.number) {
      case 1: request.model_name = field.bytes; break;
      case 2: request.model_version = field.bytes; break;
      case 3: break;  // the id, given back to each request
      case 5: {
        request.inputs.emplace_back();
        if (!ReadInput(field.bytes, request.inputs.back())) return std::nullopt;
        break;
      }
      case 6: {
        if (wire::FindField(field.bytes, 2)) return std::nullopt;  // an output's parameters
        request.outputs.push_back(message.substr(field.begin, field.end - field.begin));
        break;
      }
      case 7: raws.push_back(field.bytes); break;
      default: return std::nullopt;  // the request's parameters: each goes alone
    }
  }
  if (fields.failed() || request.inputs.empty() || raws.size() != request.inputs.size()) return std::nullopt;
  request.key.append(request.model_name).push_back('\0');
  request.key.append(request.model_version).push_back('\0');
  request.key.append(caller).push_back('\0');
  for (size_t i = 0; i < raws.size(); ++i) {
    auto& input = request.inputs[i];
    input.raw = raws[i];
    int64_t per_row = RowElements(input.shape);
    int64_t rows = input.shape[0];
    if (per_row < 0 || rows < 1 || (i > 0 && rows != request.rows)) return std::nullopt;
    if (per_row > 0 && rows > (int64_t{1} << 40) / per_row) return std::nullopt;
    if (input.datatype == "BYTES") {
      // Its elements (a 4-byte length, then the bytes) one after the other: rows join by concatenation.
      std::vector<size_t> at;
      if (!BytesRows(input.raw, per_row, {rows}, at)) return std::nullopt;
    } else {
      size_t item = ItemSize(input.datatype);
      if (item == 0 || static_cast<uint64_t>(rows * per_row) * item != input.raw.size()) return std::nullopt;
    }
    request.rows = rows;
    request.key.append(input.name).push_back('\0');
    request.key.append(input.datatype).push_back('\0');
    for (size_t d = 1; d < input.shape.size(); ++d) request.key.append(std::to_string(input.shape[d])).push_back(',');
    request.key.push_back('\0');
  }
  for (auto output : request.outputs) request.key.append(output);
  return request;
}

grpc::Status StatusOf(std::string_view message, std::string_view reply) {
  constexpr std::string_view kStatusParameter = "pipeline.status";  // base64 of a google.rpc.Status
  auto parameter = wire::FindParameter(reply, 4, kStatusParameter);
  auto decoded = parameter ? wire::Base64Decode(wire::StringParameter(*parameter)) : std::nullopt;
  if (decoded) {
    wire::Reader fields(*decoded);
    wire::Field field;
    int code = static_cast<int>(grpc::StatusCode::UNKNOWN);
    std::string text(message);
    while (fields.Next(field)) {
      if (field.number == 1 && field.type == wire::kVarint) code = static_cast<int>(field.varint);
      if (field.number == 2 && field.type == wire::kLengthDelimited) text = std::string(field.bytes);
    }
    if (!fields.failed() && code > 0 && code <= 16) {
      bool details = wire::FindField(*decoded, 3).has_value();
      return grpc::Status(static_cast<grpc::StatusCode>(code), text, details ? *decoded : std::string());
    }
  }
  return grpc::Status(grpc::StatusCode::UNKNOWN, std::string(message));
}

int64_t Batcher::Limit(const std::string& model) {
  if (inflight_ <= 0) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = models_.find(model);
  return found == models_.end() ? 0 : found->second.limit;
}

void Batcher::Learn(const std::string& model, int64_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = models_.find(model);
  if (found != models_.end()) found->second.limit = limit;
  else if (limit > 0) models_[model].limit = limit;
}

void Batcher::Submit(const std::string& model, Member* member) {
  bool tracked = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& state = models_[model];
    if (state.inflight >= inflight_ || !state.queue.empty()) {
      const Mergeable& request = member->mergeable();
      if (state.queued_rows + request.rows <= state.limit * inflight_ &&
          state.queued_bytes + request.bytes <= max_bytes_ * static_cast<size_t>(inflight_)) {
        state.queue.push_back(member);
        state.queued_rows += request.rows;
        state.queued_bytes += request.bytes;
        return;
      }
      tracked = false;  // the queue is full: the router's door decides
    } else {
      ++state.inflight;
    }
  }
  member->SendAlone(tracked);
}

void Batcher::Dequeued(Model& state, const Member* member) {
  state.queued_rows -= member->mergeable().rows;
  state.queued_bytes -= member->mergeable().bytes;
}

std::vector<Member*> Batcher::Take(Model& state) {
  std::vector<Member*> members{state.queue.front()};
  state.queue.pop_front();
  Dequeued(state, members[0]);
  const Mergeable& first = members[0]->mergeable();
  int64_t rows = first.rows;
  size_t bytes = first.bytes;
  for (auto it = state.queue.begin(); it != state.queue.end();) {
    const Mergeable& next = (*it)->mergeable();
    if (next.key == first.key && rows + next.rows <= state.limit && bytes + next.bytes <= max_bytes_) {
      rows += next.rows;
      bytes += next.bytes;
      members.push_back(*it);
      Dequeued(state, *it);
      it = state.queue.erase(it);
    } else {
      ++it;
    }
  }
  return members;
}

void Batcher::Done(const std::string& model) {
  std::vector<Member*> alone;
  std::vector<std::shared_ptr<Batch>> batches;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& state = models_[model];
    --state.inflight;
    while (state.inflight < inflight_ && !state.queue.empty()) {
      auto members = Take(state);
      ++state.inflight;
      if (members.size() == 1) {
        alone.push_back(members[0]);
        continue;
      }
      auto batch = std::make_shared<Batch>(*this, model, members);
      for (Member* member : members) state.batched.emplace(member, batch);
      batches.push_back(std::move(batch));
    }
  }
  for (Member* member : alone) member->SendAlone(true);
  for (auto& batch : batches) batch->Send();
}

bool Batcher::Withdraw(const std::string& model, Member* member, std::shared_ptr<Batch>& batch) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = models_.find(model);
  if (found == models_.end()) return false;
  auto& state = found->second;
  auto queued = std::find(state.queue.begin(), state.queue.end(), member);
  if (queued != state.queue.end()) {
    Dequeued(state, member);
    state.queue.erase(queued);
    return true;
  }
  auto in_batch = state.batched.find(member);
  if (in_batch != state.batched.end()) batch = in_batch->second;
  return false;
}

Batch::Batch(Batcher& batcher, std::string model, std::vector<Member*> members)
    : batcher_(batcher), model_(std::move(model)), members_(std::move(members)), left_(members_.size(), false) {}

void Batch::Send() {
  const Mergeable& first = members_[0]->mergeable();
  int64_t rows = 0;
  int64_t timeout = 0;
  bool forever = false;
  for (Member* member : members_) {
    rows += member->mergeable().rows;
    int64_t left = member->TimeLeftUs();
    if (left == 0) forever = true;
    timeout = std::max(timeout, left);
  }
  std::string body;
  wire::PutBytes(body, 1, first.model_name);
  if (!first.model_version.empty()) wire::PutBytes(body, 2, first.model_version);
  for (const auto& input : first.inputs) {
    std::string tensor;
    wire::PutBytes(tensor, 1, input.name);
    wire::PutBytes(tensor, 2, input.datatype);
    PutShape(tensor, rows, input.shape);
    wire::PutBytes(body, 5, tensor);
  }
  for (auto output : first.outputs) body.append(output);
  for (size_t i = 0; i < first.inputs.size(); ++i) {
    size_t size = 0;
    for (Member* member : members_) size += member->mergeable().inputs[i].raw.size();
    wire::PutTag(body, 7, wire::kLengthDelimited);
    wire::PutVarint(body, size);
    for (Member* member : members_) body.append(member->mergeable().inputs[i].raw);
  }
  std::string tail;
  if (!forever && timeout > 0) wire::PutInt64Parameter(tail, "pipeline.timeout_us", timeout);
  tail += members_[0]->credentials();
  wire::PutInt64Parameter(tail, kMergedParameter, static_cast<int64_t>(members_.size()));
  self_ = shared_from_this();
  auto connection = batcher_.door().Pick();
  std::string key = connection ? connection->Send({SliceOf(std::move(body))}, std::move(tail), this) : "";
  if (key.empty()) {
    Fail(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is not reachable (its door has no connection)"));
    return;
  }
  bool forget;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    connection_ = connection;
    key_ = key;
    forget = !over_ && leaving_ == members_.size();
  }
  if (forget && connection->Forget(key)) Fail(grpc::Status::CANCELLED);
}

void Batch::Leave(Member* member) {
  std::shared_ptr<Connection> connection;
  std::string key;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto at = std::find(members_.begin(), members_.end(), member) - members_.begin();
    if (over_ || left_[at]) return;
    left_[at] = true;
    if (++leaving_ < members_.size() || !connection_) return;
    connection = connection_;
    key = key_;
  }
  if (connection->Forget(key)) Fail(grpc::Status::CANCELLED);
}

template <typename F>
void Batch::Complete(F answer) {
  std::vector<bool> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (over_) return;
    over_ = true;
    left = left_;
  }
  auto keep = std::move(self_);  // this batch lives until the end of this call
  {
    std::lock_guard<std::mutex> lock(batcher_.mutex_);
    auto& state = batcher_.models_[model_];
    for (Member* member : members_) state.batched.erase(member);
  }
  for (size_t i = 0; i < members_.size(); ++i) {
    if (left[i]) members_[i]->End(grpc::Status::CANCELLED);
    else answer(i);
  }
  batcher_.Done(model_);
}

void Batch::Fail(const grpc::Status& status) {
  Complete([&](size_t i) { members_[i]->End(status); });
}

void Batch::Answer(grpc::Slice payload) {
  std::string_view bytes(reinterpret_cast<const char*>(payload.begin()), payload.size());
  auto error = wire::FindField(bytes, 1);
  auto reply = wire::FindField(bytes, 2);
  std::string_view replied = reply ? reply->bytes : std::string_view{};
  if (error && !error->bytes.empty()) {
    auto resend = wire::FindParameter(replied, 4, kResendParameter);
    if (resend && wire::BoolParameter(*resend)) {
      Complete([&](size_t i) { members_[i]->SendAlone(false); });
      return;
    }
    grpc::Status status = StatusOf(error->bytes, replied);
    Complete([&](size_t i) { members_[i]->End(status); });
    return;
  }
  std::vector<std::vector<grpc::Slice>> replies(members_.size());
  if (!reply || !Split(payload, replied, replies)) {  // not one row per item: each is answered alone
    Complete([&](size_t i) { members_[i]->SendAlone(false); });
    return;
  }
  auto limit = wire::FindParameter(replied, 4, kFrontBatchParameter);
  batcher_.Learn(model_, limit ? wire::Int64Parameter(*limit) : 0);
  Complete([&](size_t i) { members_[i]->Reply(std::move(replies[i])); });
}

// Each member's ModelInferResponse: the reply's fields but for its id, its outputs' shapes and rows.
bool Batch::Split(const grpc::Slice& payload, std::string_view reply, std::vector<std::vector<grpc::Slice>>& replies) {
  struct Output {
    std::string_view name, datatype;
    std::vector<int64_t> shape;
    std::vector<std::string_view> parameters;  // whole fields
  };
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (Member* member : members_) {
    sizes.push_back(member->mergeable().rows);
    total += sizes.back();
  }
  size_t base = static_cast<size_t>(reply.data() - reinterpret_cast<const char*>(payload.begin()));
  std::vector<std::pair<size_t, size_t>> kept;  // fields every member's response has as they are
  std::vector<Output> outputs;
  std::vector<std::pair<size_t, size_t>> raws;  // where each output's raw bytes are in the reply
  wire::Reader fields(reply);
  wire::Field field;
  while (fields.Next(field)) {
    if (field.number == 3) continue;
    if (field.number == 4 && field.type == wire::kLengthDelimited) {
      auto key = wire::FindField(field.bytes, 1);
      if (key && key->bytes == kFrontBatchParameter) continue;
    }
    if (field.number == 5 && field.type == wire::kLengthDelimited) {
      Output output;
      wire::Reader parts(field.bytes);
      wire::Field part;
      while (parts.Next(part)) {
        if (part.number == 1 && part.type == wire::kLengthDelimited) output.name = part.bytes;
        else if (part.number == 2 && part.type == wire::kLengthDelimited) output.datatype = part.bytes;
        else if (part.number == 3) {
          if (!ReadDims(part, output.shape)) return false;
        } else if (part.number == 4) output.parameters.push_back(field.bytes.substr(part.begin, part.end - part.begin));
        else return false;  // contents: the router answers raw
      }
      if (parts.failed() || output.shape.empty() || output.shape[0] != total) return false;
      outputs.push_back(std::move(output));
      continue;
    }
    if (field.number == 6 && field.type == wire::kLengthDelimited) {
      raws.emplace_back(base + static_cast<size_t>(field.bytes.data() - reply.data()), field.bytes.size());
      continue;
    }
    kept.emplace_back(base + field.begin, base + field.end);
  }
  if (fields.failed() || outputs.size() != raws.size()) return false;
  // For each output, where each member's rows begin in its raw bytes.
  std::vector<std::vector<size_t>> starts(outputs.size());
  for (size_t j = 0; j < outputs.size(); ++j) {
    int64_t per_row = RowElements(outputs[j].shape);
    std::string_view raw(reinterpret_cast<const char*>(payload.begin()) + raws[j].first, raws[j].second);
    if (per_row < 0) return false;
    if (outputs[j].datatype == "BYTES") {
      if (!BytesRows(raw, per_row, sizes, starts[j])) return false;
      continue;
    }
    size_t item = ItemSize(outputs[j].datatype);
    if (item == 0 || raw.size() != static_cast<size_t>(total * per_row) * item) return false;
    size_t row = static_cast<size_t>(per_row) * item, at = 0;
    starts[j].push_back(0);
    for (int64_t rows : sizes) starts[j].push_back(at += row * static_cast<size_t>(rows));
  }
  for (size_t m = 0; m < members_.size(); ++m) {
    auto& pieces = replies[m];
    for (auto [from, to] : kept) pieces.push_back(payload.sub(from, to));
    const std::string& id = members_[m]->id();
    std::string head;
    if (!id.empty()) wire::PutBytes(head, 3, id);
    for (const auto& output : outputs) {
      std::string tensor;
      wire::PutBytes(tensor, 1, output.name);
      wire::PutBytes(tensor, 2, output.datatype);
      PutShape(tensor, sizes[m], output.shape);
      for (auto parameter : output.parameters) tensor.append(parameter);
      wire::PutBytes(head, 5, tensor);
    }
    pieces.push_back(SliceOf(std::move(head)));
    for (size_t j = 0; j < outputs.size(); ++j) {
      size_t from = starts[j][m], to = starts[j][m + 1];
      std::string tag;
      wire::PutTag(tag, 6, wire::kLengthDelimited);
      wire::PutVarint(tag, to - from);
      pieces.push_back(SliceOf(std::move(tag)));
      if (to > from) pieces.push_back(payload.sub(raws[j].first + from, raws[j].first + to));
    }
  }
  return true;
}

}  // namespace front
