// pipeline-front: the router's public gRPC port, in C++ on grpc++.
//
// Every ModelInfer goes to the router's door (frame connections, spread over the router's processes request by
// request); every other RPC is forwarded to the router's own gRPC port. TLS, message limits, deadlines,
// keepalive and compression are grpc++'s; everything a request means is the router's. See docs/performance.
#include <grpcpp/grpcpp.h>
#include <grpcpp/generic/generic_stub.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "calls.h"
#include "door.h"

namespace {

constexpr char kUsage[] =
    "usage: pipeline-front --listen HOST:PORT --router HOST:PORT --door HOST:PORT [--door HOST:PORT ...]\n"
    "  [--connections N] [--port-file PATH] [--max-message-bytes N] [--grace-seconds S] [--merge-inflight K]\n"
    "  [--tls-cert PEM --tls-key PEM [--tls-ca PEM]]\n"
    "The router's door secret is read from the environment (PIPELINE_FRONT_SECRET).\n";

struct Flags {
  std::string listen, router, port_file, tls_cert, tls_key, tls_ca;
  std::vector<front::Endpoint> doors;
  int connections = 2;
  long long max_message_bytes = 64LL << 20;
  double grace_seconds = 10;
  int min_ping_interval_ms = 1000;
  // Batches (or lone requests) of a model whose requests may be merged that the front keeps at the router
  // at once; past them its requests queue, and go as one batch when one comes back (0: merge none).
  int merge_inflight = 2;
};

bool SplitHostPort(const std::string& text, front::Endpoint& endpoint) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos) return false;
  endpoint.host = text.substr(0, colon);
  if (endpoint.host.size() >= 2 && endpoint.host.front() == '[') endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);
  try {
    endpoint.port = std::stoi(text.substr(colon + 1));
  } catch (...) {
    return false;
  }
  return endpoint.port > 0 && endpoint.port < 65536;
}

bool Parse(int argc, char** argv, Flags& flags, std::string& error) {
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (i + 1 >= argc) {
      error = name + " needs a value";
      return false;
    }
    std::string value = argv[++i];
    try {
      if (name == "--listen") flags.listen = value;
      else if (name == "--router") flags.router = value;
      else if (name == "--door") {
        front::Endpoint endpoint;
        if (!SplitHostPort(value, endpoint)) {
          error = "--door " + value + ": not HOST:PORT";
          return false;
        }
        flags.doors.push_back(endpoint);
      } else if (name == "--connections") flags.connections = std::stoi(value);
      else if (name == "--port-file") flags.port_file = value;
      else if (name == "--max-message-bytes") flags.max_message_bytes = std::stoll(value);
      else if (name == "--grace-seconds") flags.grace_seconds = std::stod(value);
      else if (name == "--min-ping-interval-ms") flags.min_ping_interval_ms = std::stoi(value);
      else if (name == "--merge-inflight") flags.merge_inflight = std::stoi(value);
      else if (name == "--tls-cert") flags.tls_cert = value;
      else if (name == "--tls-key") flags.tls_key = value;
      else if (name == "--tls-ca") flags.tls_ca = value;
      else {
        error = "unknown flag " + name;
        return false;
      }
    } catch (const std::exception&) {
      error = name + " " + value + ": not a number";
      return false;
    }
  }
  if (flags.listen.empty() || flags.router.empty() || flags.doors.empty()) {
    error = "--listen, --router and --door are needed";
    return false;
  }
  if (flags.connections < 1 || flags.max_message_bytes < 1 || flags.max_message_bytes > INT32_MAX) {
    error = "--connections and --max-message-bytes must be positive (and the latter below 2 GiB)";
    return false;
  }
  if (flags.tls_cert.empty() != flags.tls_key.empty() || (!flags.tls_ca.empty() && flags.tls_cert.empty())) {
    error = "TLS needs both --tls-cert and --tls-key (and --tls-ca needs them too)";
    return false;
  }
  return true;
}

bool ReadFile(const std::string& path, std::string& into) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return false;
  std::stringstream text;
  text << file.rdbuf();
  into = text.str();
  return true;
}

std::shared_ptr<grpc::ServerCredentials> CredentialsOf(const Flags& flags, std::string& error) {
  if (flags.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  if (!ReadFile(flags.tls_cert, pair.cert_chain) || !ReadFile(flags.tls_key, pair.private_key) ||
      (!flags.tls_ca.empty() && !ReadFile(flags.tls_ca, options.pem_root_certs))) {
    error = "cannot read the TLS files";
    return nullptr;
  }
  options.pem_key_cert_pairs.push_back(pair);
  if (!flags.tls_ca.empty())
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  return grpc::SslServerCredentials(options);
}

}  // namespace

// Where the router that started this process named itself (PIPELINE_PARENT_PID), Linux kills this process
// when the router ends, however it ends, so the front never holds the public port for a router that is gone;
// false where the router has ended already (this process has another parent then).
bool DieWithParent() {
  const char* parent = std::getenv("PIPELINE_PARENT_PID");
  if (parent == nullptr || *parent == '\0') return true;
  long expected = std::strtol(parent, nullptr, 10);
  unsetenv("PIPELINE_PARENT_PID");
  if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
    std::cerr << "pipeline-front: cannot ask to end with the router\n";
  }
  return static_cast<long>(getppid()) == expected;
}

int main(int argc, char** argv) {
  if (!DieWithParent()) {
    std::cerr << "pipeline-front: the router that started it has ended: exiting\n";
    return 1;
  }
  Flags flags;
  std::string error;
  if (!Parse(argc, argv, flags, error)) {
    std::cerr << "pipeline-front: " << error << "\n" << kUsage;
    return 2;
  }
  const char* secret = std::getenv("PIPELINE_FRONT_SECRET");
  if (secret == nullptr || *secret == '\0') {
    std::cerr << "pipeline-front: PIPELINE_FRONT_SECRET is not set\n";
    return 2;
  }
  auto credentials = CredentialsOf(flags, error);
  if (!credentials) {
    std::cerr << "pipeline-front: " << error << "\n";
    return 2;
  }
  // SIGTERM and SIGINT are waited for below, by this thread; every other thread has them blocked.
  sigset_t stopping;
  sigemptyset(&stopping);
  sigaddset(&stopping, SIGTERM);
  sigaddset(&stopping, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stopping, nullptr);
  signal(SIGPIPE, SIG_IGN);

  auto max_frame = static_cast<size_t>(flags.max_message_bytes) + (1 << 16);
  front::Door door(flags.doors, flags.connections, secret, max_frame);
  if (!door.Open(30, error)) {
    std::cerr << "pipeline-front: cannot open the router's door: " << error << "\n";
    return 1;
  }
  grpc::ChannelArguments channel;
  channel.SetMaxReceiveMessageSize(static_cast<int>(flags.max_message_bytes));
  channel.SetMaxSendMessageSize(static_cast<int>(flags.max_message_bytes));
  auto router = grpc::CreateCustomChannel(flags.router, grpc::InsecureChannelCredentials(), channel);

  front::Service service(door, router,
                         {!flags.tls_ca.empty(), secret, flags.merge_inflight, static_cast<size_t>(flags.max_message_bytes)});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, credentials, &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(flags.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(flags.max_message_bytes));
  // Clients' keepalive pings are welcome, with calls open or not, as on the router's own port.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, flags.min_ping_interval_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.RegisterCallbackGenericService(&service);
  auto server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "pipeline-front: cannot listen on " << flags.listen << "\n";
    return 1;
  }
  if (!flags.port_file.empty()) {
    std::string temporary = flags.port_file + ".tmp";
    std::ofstream(temporary) << port;
    std::rename(temporary.c_str(), flags.port_file.c_str());
  }
  std::cerr << "pipeline-front: serving on port " << port << ", " << flags.doors.size()
            << " router processes behind it\n";
  int signum = 0;
  sigwait(&stopping, &signum);
  // Drain: no new call; those in flight get the grace period, then are cancelled.
  auto deadline = std::chrono::system_clock::now() + std::chrono::duration<double>(flags.grace_seconds);
  server->Shutdown(std::chrono::time_point_cast<std::chrono::system_clock::duration>(deadline));
  server->Wait();
  return 0;
}
