"""The client, inside the trainer: reads a pipeline through the service.

`distribute` registers pipelines and makes the `DistributedNode` a read
starts from; `read` is what a read's threads share (its job, heartbeats and
tasks), `fetcher` reads one task's stream from its worker, `iterator` hands
the elements to the consumer, and `task_stats` asks the workers for their
pipelines' statistics.
"""
