"""How this project's servers send inference requests to one another: the stage-transport seam, its
client half and the server half of the frame transport.

`server_link.ServerLink` is the one interface: one server's gRPC stub, and for `ModelInfer` the cheapest
transport that server offers, chosen there and nowhere else. Behind it:
- `frame_client`: the frame protocol's connection (many requests on one plain or TLS stream);
- `grpc_stream`: one shared `ModelStreamInfer` stream, and the stream of a decoupled model's responses;
- a unary `ModelInfer` call, for servers that offer neither and calls that carry a client's own metadata.
The first two share `matched`: requests and their responses matched by `id`, failing as a unary call would,
and a request cut off by the end of its connection, whichever carried it, with `ConnectionRecycled`.

The router calls its stages' replicas through it (which replica is the router's business:
`pipeline.router.stages.replicas`), and the stages send their models' calls (BLS) to the router through it.

The other end of a frame connection is `frame_server.FrameServer`, a server's frame port: a door over the
server's `InferenceHandler` (`pipeline.runtime.handler`), as its gRPC servicer is. Both ends read and write
frames with `frame_protocol.FrameProtocol`.

The client half knows neither the router nor the stage runtime; the server half stands on the runtime's
handler, and on neither the router nor the stages. What they need of it is here: `ServerLink`,
`ConnectionRecycled`, `FrameServer` and `frame_server_of`; no module outside this package imports the
transports' own modules."""

from pipeline.transport.frame_server import FrameServer, frame_server_of
from pipeline.transport.matched import ConnectionRecycled
from pipeline.transport.server_link import ServerLink

__all__ = ["ConnectionRecycled", "FrameServer", "ServerLink", "frame_server_of"]
