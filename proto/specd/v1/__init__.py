"""Generated gRPC stubs for the `specd.v1` wire contract; regenerate with proto/generate.sh."""
