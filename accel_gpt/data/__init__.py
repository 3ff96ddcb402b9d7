"""Token data: `prepare` (text -> shards, with `sources`, `encode`, `pipeline`, `merge`), `shards` (the on-disk
format), `loader` (token windows)."""
