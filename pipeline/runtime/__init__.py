"""What every server stands on: the protocol servicer and its error mapping, server bootstrap, metrics,
statistics, tracing, security and the model repository's layout."""
