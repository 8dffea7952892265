"""The router's front door beside the gRPC servicer it shares with the stages (`pipeline.runtime.servicer`):
the Open Inference Protocol's HTTP/REST API (`http`), its JSON codec (`rest_codec`), and the worker processes
that take the codec's heavy work off the event loop (`codec_pool`)."""
