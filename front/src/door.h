// The router's door: frame connections (pipeline/protocol/frames.py) to each of its processes, over which
// the front sends every ModelInfer and gets its answer back, matched by the id the front gave it.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace front {

// Frame kinds and the header: the payload's length (4 bytes, little-endian) and its kind.
constexpr uint8_t kHello = 1, kRequest = 2, kResponse = 3, kCancel = 4;
constexpr size_t kHeaderBytes = 5;

// Whoever waits for a request's answer: exactly one of the two is called, once, on a connection's thread.
class Waiter {
 public:
  virtual ~Waiter() = default;
  // The answer's frame payload (a ModelStreamInferResponse), as a slice the waiter may keep.
  virtual void Answer(grpc::Slice payload) = 0;
  // The connection broke before the answer came.
  virtual void Fail(const grpc::Status& status) = 0;
};

struct Endpoint {
  std::string host;
  int port = 0;
};

// One frame connection to a router process: requests written by whichever thread sends (the frames queued
// while one thread writes go out in its next system call), answers read by a thread of its own.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Endpoint endpoint, std::string secret, size_t max_frame_bytes);
  ~Connection();
  // Connect and say hello; false (with `error` said) where the router is not there or refuses.
  bool Open(std::string& error);
  // Send a request: its message's `body` then `tail` (the hop's parameters), with `id` set to a key of the
  // connection's own, after which `waiter` is answered. Returns the key, or "" where the connection broke.
  std::string Send(const std::vector<grpc::Slice>& body, std::string tail, Waiter* waiter);
  // Stop waiting for the request of `key`: true where it was still waited for (then the router is told to
  // stop it, and its waiter is never called), false where its answer is being given.
  bool Forget(const std::string& key);
  bool usable() const { return !broken_.load(std::memory_order_acquire); }
  size_t waiting();

 private:
  struct Outgoing {
    char header[kHeaderBytes];
    std::vector<grpc::Slice> body;
    std::string tail;
  };
  void Write(Outgoing frame);
  void Read();
  void Break(const std::string& reason);
  bool ReadExactly(char* into, size_t size);

  Endpoint endpoint_;
  std::string secret_;
  size_t max_frame_bytes_;
  int fd_ = -1;
  bool cancels_ = false;
  std::atomic<bool> broken_{false};
  std::atomic<uint64_t> next_key_{0};
  std::mutex waiting_mutex_;
  std::unordered_map<std::string, Waiter*> waiting_;
  std::mutex write_mutex_;
  std::vector<Outgoing> queued_;
  bool writing_ = false;
  std::thread reader_;
};

// Every connection to every router process; requests are spread over them one by one.
class Door {
 public:
  Door(std::vector<Endpoint> endpoints, int per_endpoint, std::string secret, size_t max_frame_bytes);
  ~Door();
  // Open every connection, trying for `seconds`; false (error said) where one could not be opened.
  bool Open(double seconds, std::string& error);
  // The next usable connection, or null where none is.
  std::shared_ptr<Connection> Pick();

 private:
  void Mend();  // reopens broken connections, in the background

  std::vector<Endpoint> endpoints_;
  std::string secret_;
  size_t max_frame_bytes_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<Connection>> connections_;  // `per_endpoint` for each endpoint, in turn
  std::atomic<uint64_t> turn_{0};
  std::atomic<bool> stopping_{false};
  std::condition_variable stop_;
  std::thread mender_;
};

}  // namespace front
