"""The decode worker: a gRPC server around one Engine, hosting many sessions' caches between turns."""
