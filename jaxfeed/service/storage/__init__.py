"""The dispatcher's durable state in its work_dir: a write-ahead `journal`
(its `journal_lock` batches a state change's `journal_records`) of checked
`journal_lines`, read back by `journal_replay` and compacted by
`state_snapshot`s."""
