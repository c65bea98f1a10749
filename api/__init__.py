"""The HTTP api: stateless replicas that queue requests in Redis and relay their tokens."""
