"""The op graph: one op per module, each depending only on base."""
