"""How one of this project's servers sends inference requests to another over a connection it keeps: requests
and their responses matched by `id` on one stream (`matched`), and the frame protocol's client
(`frame_client`), which the router uses to call its stages and the stages use to send their models' calls
(BLS) to the router. It knows neither the router nor the stage runtime."""
