"""Token data: `prepare` (text -> shards), `shards` (the on-disk format), `loader` (token windows)."""
