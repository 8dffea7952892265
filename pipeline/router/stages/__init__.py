"""The stages behind the router: the client of one stage (`stage_client`: its calls, retries and errors), its
replicas and the choice of one for each call (`replicas`; sequences in `sequence_placement`), where a stage
is (`targets`), the retry policy (`retry`), what a stage says about its models (`stage_models`), which stage
serves each model (`discovery`), and model management across every replica (`fleet`). How a call travels to
a replica is `pipeline.transport`'s."""
