"""What the dispatcher, workers and clients exchange, and how.

Control messages are protobuf (`protos/`) over gRPC (`rpc`, and `rpc_server`
for the servers' side; `rpc_errors` counts failed calls); batches travel as
`wire` frames, over gRPC in `element_chunks` or over a raw `data_socket`.
Pipelines travel as a `spec` whose `import_paths` must lie in allowed
modules, with their `sharding` policy; `read_state` and `stream_state` are
where a resumed read stands, which it sends back to the service.
"""
