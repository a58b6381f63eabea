"""What runs beside the transports: counters, Prometheus metrics, torn-read checks."""
