"""Raincheck Serve's services: gRPC frontend, decode worker, Ray deferred workers, CLI."""
