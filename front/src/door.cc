#include "door.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <utility>

#include "wire.h"

namespace front {

namespace {

// Bytes read at once while no large payload is being read.
constexpr size_t kScratch = 64 * 1024;
// The hello's parameter that carries the door's secret, and the answer's that says CANCEL is taken
// (pipeline.protocol.frames).
constexpr char kDoorParameter[] = "pipeline.door";
constexpr char kCancelsParameter[] = "pipeline.cancels";

void PutHeader(char* header, size_t length, uint8_t kind) {
  uint32_t n = static_cast<uint32_t>(length);
  header[0] = static_cast<char>(n & 0xFF);
  header[1] = static_cast<char>((n >> 8) & 0xFF);
  header[2] = static_cast<char>((n >> 16) & 0xFF);
  header[3] = static_cast<char>((n >> 24) & 0xFF);
  header[4] = static_cast<char>(kind);
}

uint32_t LengthOf(const char* header) {
  const auto* b = reinterpret_cast<const unsigned char*>(header);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

int Dial(const Endpoint& endpoint, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::string port = std::to_string(endpoint.port);
  if (int rc = getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    error = gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* at = found; at != nullptr; at = at->ai_next) {
    fd = socket(at->ai_family, at->ai_socktype | SOCK_CLOEXEC, at->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, at->ai_addr, at->ai_addrlen) == 0) break;
    error = strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(found);
  if (fd >= 0) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  return fd;
}

grpc::Slice SliceOf(std::string bytes) {
  auto* owned = new std::string(std::move(bytes));
  return grpc::Slice(owned->data(), owned->size(), [](void* p) { delete static_cast<std::string*>(p); }, owned);
}

}  // namespace

Connection::Connection(Endpoint endpoint, std::string secret, size_t max_frame_bytes)
    : endpoint_(std::move(endpoint)), secret_(std::move(secret)), max_frame_bytes_(max_frame_bytes) {}

Connection::~Connection() {
  if (reader_.joinable()) reader_.detach();
  if (fd_ >= 0) close(fd_);
}

bool Connection::ReadExactly(char* into, size_t size) {
  while (size > 0) {
    ssize_t n = recv(fd_, into, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    into += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool Connection::Open(std::string& error) {
  fd_ = Dial(endpoint_, error);
  if (fd_ < 0) return false;
  std::string hello;
  wire::PutBytes(hello, 3, "hello");
  wire::PutStringParameter(hello, kDoorParameter, secret_);
  char header[kHeaderBytes];
  PutHeader(header, hello.size(), kHello);
  std::string frame(header, kHeaderBytes);
  frame += hello;
  if (send(fd_, frame.data(), frame.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(frame.size())) {
    error = "cannot send the hello";
    return false;
  }
  if (!ReadExactly(header, kHeaderBytes) || header[4] != kResponse || LengthOf(header) > max_frame_bytes_) {
    error = "the router did not answer the hello";
    return false;
  }
  std::string answer(LengthOf(header), '\0');
  if (!ReadExactly(answer.data(), answer.size())) {
    error = "the router did not answer the hello";
    return false;
  }
  if (auto refused = wire::FindField(answer, 1); refused && !refused->bytes.empty()) {
    error = "the router refused the hello: " + std::string(refused->bytes);
    return false;
  }
  if (auto reply = wire::FindField(answer, 2)) {
    if (auto cancels = wire::FindParameter(reply->bytes, 4, kCancelsParameter))
      cancels_ = wire::BoolParameter(*cancels);
  }
  reader_ = std::thread([self = shared_from_this()] { self->Read(); });
  return true;
}

std::string Connection::Send(const std::vector<grpc::Slice>& body, std::string tail, Waiter* waiter) {
  std::string key = "d" + std::to_string(next_key_.fetch_add(1, std::memory_order_relaxed));
  wire::PutBytes(tail, 3, key);  // the request's id on this connection: the last `id` field wins
  size_t length = tail.size();
  for (const auto& slice : body) length += slice.size();
  {
    std::lock_guard<std::mutex> lock(waiting_mutex_);
    if (broken_.load(std::memory_order_acquire)) return "";
    waiting_.emplace(key, waiter);
  }
  Outgoing frame{{}, body, std::move(tail)};
  PutHeader(frame.header, length, kRequest);
  Write(std::move(frame));
  return key;
}

bool Connection::Forget(const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(waiting_mutex_);
    if (waiting_.erase(key) == 0) return false;
  }
  if (cancels_ && usable()) {
    Outgoing frame{{}, {}, key};
    PutHeader(frame.header, key.size(), kCancel);
    Write(std::move(frame));
  }
  return true;
}

size_t Connection::waiting() {
  std::lock_guard<std::mutex> lock(waiting_mutex_);
  return waiting_.size();
}

void Connection::Write(Outgoing frame) {
  std::unique_lock<std::mutex> lock(write_mutex_);
  queued_.push_back(std::move(frame));
  if (writing_) return;  // the thread writing takes it with the next batch
  writing_ = true;
  while (!queued_.empty()) {
    std::vector<Outgoing> batch;
    batch.swap(queued_);
    lock.unlock();
    std::vector<iovec> pieces;
    for (auto& f : batch) {
      pieces.push_back({f.header, kHeaderBytes});
      for (auto& slice : f.body) pieces.push_back({const_cast<uint8_t*>(slice.begin()), slice.size()});
      if (!f.tail.empty()) pieces.push_back({f.tail.data(), f.tail.size()});
    }
    size_t at = 0;
    bool failed = broken_.load(std::memory_order_acquire);
    while (at < pieces.size() && !failed) {
      int count = static_cast<int>(std::min<size_t>(pieces.size() - at, IOV_MAX));
      msghdr message{};
      message.msg_iov = &pieces[at];
      message.msg_iovlen = count;
      ssize_t n = sendmsg(fd_, &message, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        failed = true;
        break;
      }
      auto written = static_cast<size_t>(n);
      while (at < pieces.size() && written >= pieces[at].iov_len) written -= pieces[at++].iov_len;
      if (written > 0) {
        pieces[at].iov_base = static_cast<char*>(pieces[at].iov_base) + written;
        pieces[at].iov_len -= written;
      }
    }
    if (failed) Break("the router's frame connection broke while sending");
    lock.lock();
  }
  writing_ = false;
}

void Connection::Read() {
  std::string scratch(kScratch, '\0');
  size_t held = 0;
  std::string reason = "the router closed its frame connection";
  for (;;) {
    ssize_t n = recv(fd_, scratch.data() + held, scratch.size() - held, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    held += static_cast<size_t>(n);
    size_t at = 0;
    bool broke = false;
    while (held - at >= kHeaderBytes) {
      uint32_t length = LengthOf(&scratch[at]);
      uint8_t kind = static_cast<uint8_t>(scratch[at + 4]);
      if (length > max_frame_bytes_) {
        reason = "the router sent a frame larger than the limit";
        broke = true;
        break;
      }
      std::string payload;
      size_t start = at + kHeaderBytes;
      if (held - start >= length) {
        payload.assign(&scratch[start], length);
        at = start + length;
      } else {  // the rest of a large payload is read straight into its own buffer
        payload.resize(length);
        size_t have = held - start;
        std::memcpy(payload.data(), &scratch[start], have);
        if (!ReadExactly(payload.data() + have, length - have)) {
          broke = true;
          break;
        }
        at = held;
      }
      if (kind != kResponse) continue;
      auto reply = wire::FindField(payload, 2);
      auto id = reply ? wire::FindField(reply->bytes, 3) : std::nullopt;
      if (!id) continue;
      Waiter* waiter = nullptr;
      {
        std::lock_guard<std::mutex> lock(waiting_mutex_);
        auto found = waiting_.find(std::string(id->bytes));
        if (found == waiting_.end()) continue;  // its caller stopped waiting
        waiter = found->second;
        waiting_.erase(found);
      }
      waiter->Answer(SliceOf(std::move(payload)));
    }
    if (broke) break;
    held -= at;
    if (held > 0 && at > 0) std::memmove(scratch.data(), &scratch[at], held);
  }
  Break(reason);
}

void Connection::Break(const std::string& reason) {
  if (broken_.exchange(true)) return;
  shutdown(fd_, SHUT_RDWR);  // the reader sees the end; the fd stays open until the last owner goes
  std::unordered_map<std::string, Waiter*> waiting;
  {
    std::lock_guard<std::mutex> lock(waiting_mutex_);
    waiting.swap(waiting_);
  }
  grpc::Status status(grpc::StatusCode::UNAVAILABLE, reason);
  for (auto& [key, waiter] : waiting) waiter->Fail(status);
}

Door::Door(std::vector<Endpoint> endpoints, int per_endpoint, std::string secret, size_t max_frame_bytes)
    : secret_(std::move(secret)), max_frame_bytes_(max_frame_bytes) {
  for (int i = 0; i < per_endpoint; ++i)
    for (const auto& endpoint : endpoints) endpoints_.push_back(endpoint);
  connections_.resize(endpoints_.size());
}

Door::~Door() {
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.notify_all();
  }
  if (mender_.joinable()) mender_.join();
}

bool Door::Open(double seconds, std::string& error) {
  auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    for (;;) {
      auto connection = std::make_shared<Connection>(endpoints_[i], secret_, max_frame_bytes_);
      if (connection->Open(error)) {
        std::lock_guard<std::mutex> lock(mutex_);
        connections_[i] = connection;
        break;
      }
      if (std::chrono::steady_clock::now() > until) {
        error = endpoints_[i].host + ":" + std::to_string(endpoints_[i].port) + ": " + error;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  mender_ = std::thread([this] { Mend(); });
  return true;
}

std::shared_ptr<Connection> Door::Pick() {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t count = connections_.size();
  for (size_t tries = 0; tries < count; ++tries) {
    auto& connection = connections_[turn_.fetch_add(1, std::memory_order_relaxed) % count];
    if (connection && connection->usable()) return connection;
  }
  return nullptr;
}

void Door::Mend() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    stop_.wait_for(lock, std::chrono::milliseconds(200));
    for (size_t i = 0; i < connections_.size() && !stopping_; ++i) {
      if (connections_[i] && connections_[i]->usable()) continue;
      lock.unlock();
      auto connection = std::make_shared<Connection>(endpoints_[i], secret_, max_frame_bytes_);
      std::string error;
      bool opened = connection->Open(error);
      lock.lock();
      if (opened) connections_[i] = connection;
    }
  }
}

}  // namespace front
