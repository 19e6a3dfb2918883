"""Private implementation modules of shard_planner; import from ``shard_planner`` instead."""
