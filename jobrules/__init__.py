"""The requests, and their rules, shared by the REST layer and the trainer (standard library and
pydantic only): `spec` defines the JobSpec and the selection request once, `space` expands a
selection batch's search space, `sizing` gives each layer's parameters and memory working set,
`stopping` says why early stopping stopped a trial. The API validates with the same code the
trainer runs; a test keeps this package free of torch and of the service layers."""
