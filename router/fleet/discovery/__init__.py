"""Where the replica list comes from when it is not fixed: a watched replicas file or
Kubernetes pods. Each source yields the full list; ``RouterService.sync_replicas`` applies the
difference."""
