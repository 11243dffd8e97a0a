"""What the dispatcher, workers and clients exchange, and how.

Control messages are protobuf (`protos/`) over gRPC (`rpc`, `rpc_errors`);
batches travel as `wire` frames, over gRPC in `element_chunks` or over a raw
`data_socket`. Pipelines travel as a `spec`, with their `sharding` policy;
`read_state` and `stream_state` are the positions a resumed read sends back.
"""
