"""The run's helpers that talk to the outside: alerts (Slack, webhooks), scheduled jobs,
host and GPU health sampling, and the Prometheus endpoint.
"""
