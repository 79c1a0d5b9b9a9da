"""The replicas and their state: membership (flags, a watched file, Kubernetes pods), health
checks, metrics scraping for load, and data-parallel ranks as routing targets. The fleet
never imports the decision or the HTTP surface."""
