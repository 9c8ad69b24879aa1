"""Common code of the ontofabric services: settings, logging, telemetry, connections, embedder, runtime."""
