"""What the frontend and the decode worker share: settings, logging, metrics, gRPC helpers, the store.

Nothing here imports torch or raincheck_core, so a frontend process stays light."""
