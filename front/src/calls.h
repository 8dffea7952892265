// The calls the front serves: each ModelInfer handed to the router's door as a frame (InferCall), every other
// RPC forwarded as it is to the router's own gRPC port (ProxyCall).
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>

#include <memory>
#include <string>

#include "batches.h"
#include "door.h"

namespace front {

struct Settings {
  // Verified client certificates' identities are passed on (the router checks them as it checks its own
  // clients'): only where the front asks for client certificates.
  bool client_certificates = false;
  // The secret every forwarded call carries: the router's gRPC port answers it alone, and takes the
  // identities the front passes on in metadata with it.
  std::string secret;
  // Batches of each model the front may merge requests of, at most, at the router at once (0: merge none).
  int merge_inflight = 2;
  // The largest message the router takes: a merged request is never larger.
  size_t max_message_bytes = 64 << 20;
};

class Service final : public grpc::CallbackGenericService {
 public:
  Service(Door& door, std::shared_ptr<grpc::Channel> router, Settings settings)
      : door_(door), stub_(std::move(router)), settings_(std::move(settings)), batcher_(door, settings_.merge_inflight, settings_.max_message_bytes) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;

 private:
  Door& door_;
  grpc::GenericStub stub_;
  Settings settings_;
  Batcher batcher_;
};

}  // namespace front
