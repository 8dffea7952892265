"""The router's HTTP door beside the gRPC servicer it shares with the stages (`pipeline.runtime.servicer`),
over the same `InferenceHandler` (`pipeline.runtime.handler`): the Open Inference Protocol's HTTP/REST API (`http`), its JSON codec (`rest_codec`), and the worker processes
that take the codec's heavy work off the event loop (`codec_pool`)."""
