"""The worker: registers with the dispatcher, runs tasks, serves their batches.

`server` runs a worker process with the options of `config` and serves its
`state` (tasks, client streams, heartbeats) over gRPC and its `data_server`
port. `task_pipeline` builds a task's pipeline, `task_runner` runs it into a
bounded buffer, `round_assembly` groups its batches into rounds for
round-robin reads, `shared_stream` shares one pipeline between jobs, and
`delivery` keeps each client's stream resumable across connections. Run it
with `python -m jaxfeed.service.worker` (see `__main__`).
"""
