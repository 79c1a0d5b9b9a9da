"""What operators look at: Prometheus metrics, the dashboard (page and data), and the readiness
probe."""
