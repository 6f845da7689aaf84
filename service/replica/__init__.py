"""One replica: assembled from the settings, started, drained and stopped, with its shard
processes."""
