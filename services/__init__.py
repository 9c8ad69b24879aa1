"""The ontofabric workers and the command line."""
