"""Protocol buffers of record formats jaxfeed reads (tf.train.Example)."""
