"""The load-testing harness (loadtest.py, no torch) and the peer benchmark (peers.py)."""
