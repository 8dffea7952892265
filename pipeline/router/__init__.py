"""The router: serves every ensemble as a model and runs its steps on the stage services, batching each
stage's calls; the stage models behind the ensembles are served through it too.

`main` is the process and `workers` its several processes on one port; `router_plane` the data plane behind
its inference handler and doors, and `registry` what it knows of each model it serves. The rest is grouped by concern:
`frontdoor` (HTTP/REST and its codec), `execution` (ensembles run, and which can be served), `scheduling`
(batching and the stage-call path), `stages` (the stages' clients, replicas and models) and `caching` (the
response cache)."""
