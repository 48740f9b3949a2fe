"""The load-testing harness (loadtest.py, no torch) and the peer benchmark: systems.py runs the
systems, report.py turns their runs into figures, tables and a plot (no torch)."""
