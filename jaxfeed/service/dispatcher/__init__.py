"""The dispatcher: datasets, jobs, workers, clients and splits; no data.

`server` serves `state` (its bookkeeping, with `workers` and `tables`) over
gRPC with the options of `config`, and its `health` (the journal's) over
grpc.health.v1; `heartbeat_pacing` and `task_lists` keep it fast with
thousands of parties; `autoscale` resizes an elastic pool, or, under the
per_job policy, `job_autoscaler` sizes each job's own workers (the rule in
`job_scaling`, which worker serves which job in `job_grants`).
Run it with `python -m jaxfeed.service.dispatcher` (see `__main__`).
"""
