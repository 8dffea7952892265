"""The router: serves every ensemble as a model and runs its steps on the stage services, batching each
stage's calls; the stage models behind the ensembles are served through it too."""
