"""Private modules of shard_planner.projection; import from ``shard_planner.projection``."""
