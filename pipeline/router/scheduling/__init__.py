"""How the router schedules the calls of a stage model: one request per call, or queued and merged into batches,
as the dispatcher decides (`dispatch`), by the batchers it owns (`stage_batchers`); dynamic batching
(`batching`, its time in `clock`, its spans in `batch_spans`); merging requests' tensors into a batch and
splitting its outputs back (`merge`); and the models that stage models call (BLS), learnt so that their
batchers wait for calls on their way (`bls_forecast`)."""
