"""The dispatcher's durable state in its work_dir: a write-ahead `journal`
of checked `journal_records`, compacted by `state_snapshot`s."""
