"""The project's tooling, apart from the serving runtime: `pipeline run` (launcher), `pipeline bench`
(bench), `pipeline trace` (trace_view) and the protocol stubs' generator (codegen)."""
