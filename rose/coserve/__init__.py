"""SLO-safe co-serving executor: serving and rollout models on one device, one page pool."""
