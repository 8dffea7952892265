"""What every server stands on: the inference handler every door shares, the gRPC servicer over it and the
error mapping, the server's life from start to stop, metrics, statistics, tracing, security and the model
repository's layout."""
