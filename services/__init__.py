"""Stage services: each package is one process that serves its stage models over the Open Inference Protocol."""
